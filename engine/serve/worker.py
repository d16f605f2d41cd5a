"""The generation worker of `python -m engine serve`: one job at a time, in a thread.

`run_job` drives `Loaded.generate` for a `Job`, turns token ids into reasoning / content
text (the template's parser, stop strings), keeps the job's timings and the server's
metrics, and emits typed events (engine/serve/protocol.py) for the response to write.
`load_engine` builds the `Loaded` model side from a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from engine.decode.stats import TokenStats
from engine.decode.steer import DEMO_NOTICE, NEG, DemoSteer, Forced, think_to_response
from engine.errors import EngineError
from engine.model.state import ModelState
from engine.serve.durable import StateDir, checkpoint_fingerprint
from engine.serve.protocol import ChatRequest, End, Event, Failed, Stopped, Token
from engine.serve.snapshots import SnapshotStore
from engine.text.chat_template import ChatTemplate, OutputParser
from engine.text.tokenizer import Tokenizer
from engine.weights.planner import MemorySettings


@dataclass
class Loaded:
    """The model side: `generate(prompt_ids, params, cancel, logits_hook, owner, keep_at)`
    yields engine.generate.GenToken-like objects (`id, seconds, index, prefill_seconds,
    stats`), resuming and keeping states of `owner` only (engine/serve/snapshots.py), also
    at the prompt positions `keep_at`."""

    tok: Tokenizer
    generate: Callable[..., Iterator[Any]]
    make_params: Callable[..., Any]
    n_ctx: int
    info: dict[str, Any] = field(default_factory=dict)  # for /props and /v1/models
    budget_gb: float | None = None
    source: Any = None
    snapshots: SnapshotStore | None = None  # None: prompt reuse is off


def _read_chars() -> int | None:
    try:
        return psutil.Process().io_counters().read_chars
    except (AttributeError, psutil.Error):
        return None


@dataclass
class LoadProgress:
    """What /health reports while the model loads. `bytes_read` counts what this process
    read since the load began (weights, via read syscalls); `checkpoint_bytes` is the size
    of the shards, so a client can show a fraction for a resident load."""

    phase: str = "starting"
    started: float = field(default_factory=time.monotonic)
    error: str | None = None
    layers_bound: int | None = None
    n_layers: int | None = None
    checkpoint_bytes: int | None = None
    _read0: int | None = field(default_factory=_read_chars)

    def as_dict(self) -> dict[str, Any]:
        read = _read_chars()
        return {
            "phase": self.phase,
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "bytes_read": read - self._read0
            if read is not None and self._read0 is not None
            else None,
            "checkpoint_bytes": self.checkpoint_bytes,
            "layers_bound": self.layers_bound,
            "n_layers": self.n_layers,
            "rss_gb": round(psutil.Process().memory_info().rss / 1e9, 3),
        }


class Metrics:
    COUNTERS = {
        "requests_total": "chat completion requests accepted",
        "requests_cancelled_total": "generations stopped because the client went away",
        "requests_failed_total": "generations that ended with an error",
        "prompt_tokens_total": "prompt tokens prefilled",
        "prompt_tokens_reused_total": "prompt tokens resumed from a kept conversation state",
        "replies_not_round_trip_total": "replies whose text renders to other ids than the "
        "model generated (the next turn prefills them again)",
        "prompt_seconds_total": "seconds spent in prefill",
        "tokens_predicted_total": "tokens generated (reasoning included)",
        "tokens_predicted_seconds_total": "seconds spent generating tokens",
        "gb_read_total": "GB read from storage by generation",
    }
    GAUGES = {
        "requests_processing": "generations running now (0 or 1)",
        "requests_deferred": "requests waiting for the generation slot",
        "model_loaded": "1 once the model is ready",
        "load_seconds": "seconds the model took to load",
        "rss_gb": "resident memory of the server process in GB",
        "budget_gb": "memory budget of the plan in GB (0 = resident, no budget)",
        "last_s_per_token": "seconds of the last generated token",
        "last_true_hit_rate": "expert cache true hit rate of the last token",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = {k: 0.0 for k in (*self.COUNTERS, *self.GAUGES)}

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.values[name] += value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self.values[name] = float(value)

    def render(self) -> str:
        self.set("rss_gb", psutil.Process().memory_info().rss / 1e9)
        lines = []
        with self._lock:
            for kind, table in (("counter", self.COUNTERS), ("gauge", self.GAUGES)):
                for name, help_text in table.items():
                    lines += [
                        f"# HELP k3_{name} {help_text}",
                        f"# TYPE k3_{name} {kind}",
                        f"k3_{name} {self.values[name]:.10g}",
                    ]
        return "\n".join(lines) + "\n"


class StopScanner:
    """Holds back text that could be the start of a stop string; reports a match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class Job:
    req: ChatRequest
    prompt_ids: list[int]
    max_new: int
    owner: str = ""  # whose kept states it may resume and keeps (snapshots.owner_of)
    reply_ends: tuple[int, ...] = ()  # where earlier replies end in the prompt (kept there)
    partial: list[int] | None = None  # a partial answer's ids so far, which this continues
    cancel: threading.Event = field(default_factory=threading.Event)
    # filled by the worker
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    prompt_s: float = 0.0
    predicted_s: float = 0.0
    content_chars: int = 0
    finish: str | None = None
    generated: list[int] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # the text sent, as the client got it
    content: list[str] = field(default_factory=list)
    cache_n: int = 0  # prompt ids resumed from a kept state (llama-server's cache_n)
    gb_read_prefill: float | None = None

    @property
    def prefilled(self) -> int:
        return len(self.prompt_ids) - self.cache_n

    def timings(self) -> dict[str, Any]:
        """llama-server's `timings` of this generation so far."""
        prompt_ms = self.prompt_s * 1000.0
        pred_ms = self.predicted_s * 1000.0
        n_p, n = self.prefilled, self.completion_tokens
        return {
            "cache_n": self.cache_n,
            "prompt_n": n_p,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_p if n_p else 0.0,
            "prompt_per_second": n_p / self.prompt_s if self.prompt_s else 0.0,
            "predicted_n": n,
            "predicted_ms": pred_ms,
            "predicted_per_token_ms": pred_ms / n if n else 0.0,
            "predicted_per_second": n / self.predicted_s if self.predicted_s else 0.0,
        }

    def usage(self) -> dict[str, Any]:
        n_p, n = len(self.prompt_ids), self.completion_tokens
        return {
            "completion_tokens": n,
            "prompt_tokens": n_p,
            "total_tokens": n_p + n,
            "prompt_tokens_details": {"cached_tokens": self.cache_n},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    def final_record(self, last: TokenStats | None, budget_gb: float | None,
                     demo: bool) -> TokenStats:
        """The answer's last record: its last token's (or the server's, if none), with
        what only the whole answer knows."""
        return replace(
            last or k3_record(None, budget_gb),
            reasoning_tokens=self.reasoning_tokens,
            gb_read_prefill=self.gb_read_prefill,
            note=self.empty_answer_note(),
            demo=DEMO_NOTICE if demo else None,
        )

    def empty_answer_note(self) -> str | None:
        """Why the content is empty when the token limit ran out inside the reasoning."""
        if self.finish == "length" and self.content_chars == 0:
            if self.reasoning_tokens:
                return (
                    f"max_tokens ({self.max_new}) ran out while the model was still reasoning "
                    f"({self.reasoning_tokens} reasoning tokens), so the answer is empty: raise "
                    "max_tokens, or set reasoning_budget_tokens below max_tokens so thinking "
                    "stops in time to answer"
                )
            return f"max_tokens ({self.max_new}) ran out before any answer text was produced"
        return None


def k3_record(tok_event: Any, budget_gb: float | None) -> TokenStats:
    """A token's statistics with what the server knows added: the RSS (measured here when
    the generator does not report it) and the plan's budget. None: before the first token."""
    stats = tok_event.stats if tok_event is not None else TokenStats()
    rss = stats.rss_gb if stats.rss_gb is not None else psutil.Process().memory_info().rss / 1e9
    budget = stats.budget_gb if stats.budget_gb is not None else budget_gb
    return replace(stats, rss_gb=rss, budget_gb=budget)


class _Text:
    """Token ids → reasoning / content text: the template's output parser, then a stop
    scanner per channel (text that could start a stop string is held back)."""

    def __init__(self, template: ChatTemplate, req: ChatRequest):
        self.parser = template.parser(thinking=req.thinking)
        self.reasoning, self.content = StopScanner(req.stop), StopScanner(req.stop)

    def feed(self, token_id: int) -> tuple[str, str, bool]:
        """(reasoning, content, a stop string matched)."""
        delta = self.parser.feed(token_id)
        reasoning, hit_r = self.reasoning.push(delta.reasoning)
        content, hit_c = self.content.push(delta.content)
        return reasoning, content, hit_r or hit_c

    def flush(self) -> tuple[str, str]:
        tail = self.parser.finish()
        return (
            self.reasoning.push(tail.reasoning)[0] + self.reasoning.flush(),
            self.content.push(tail.content)[0] + self.content.flush(),
        )


class _Hook:
    """What the worker does to each step's logits: forced tokens first (the reasoning
    budget's close-think), `ignore_eos`, then the demo steering. Its choices depend only on
    the request, the position in the answer and the ids before it, so a continued answer
    (`job.partial`) primes it with the ids so far (`prime`) and goes on as the
    uninterrupted run did, also when the cut fell inside a forced tag."""

    def __init__(self, job: Job, tok: Tokenizer, parser: OutputParser, end_ids: list[int],
                 steer_demo: bool):
        self.req, self.tok, self.parser, self.end_ids = job.req, tok, parser, end_ids
        self.forced = Forced()
        self.steer = DemoSteer(tok, parser, self.forced, seed=job.req.seed) if steer_demo else None
        self.offset = len(job.partial or ())

    def __call__(self, generated: list[int], logits: np.ndarray) -> np.ndarray:
        return self._decide(self.offset + len(generated), logits)

    def prime(self, ids: list[int]) -> None:
        """Walk the answer so far as the uninterrupted run did (`parser` fed alongside)."""
        dummy = np.zeros(self.tok.vocab_size, np.float32)
        for position, i in enumerate(ids):
            self._decide(position, dummy, given=int(i))
            self.parser.feed(int(i))

    def _decide(self, position: int, logits: np.ndarray, given: int | None = None) -> np.ndarray:
        f = self.forced.take(logits)
        if f is not None:
            return f
        if self.req.ignore_eos:  # llama-server's knob: keep generating to max_tokens
            logits = logits.copy()
            logits[self.end_ids] = NEG
        budget, parser = self.req.reasoning_budget, self.parser
        if (
            budget >= 0
            and parser.in_reasoning
            and not parser.in_tag
            and parser.reasoning_tokens >= budget
        ):
            self.forced.push(think_to_response(self.tok))
            tags = self.forced.take(logits)
            assert tags is not None  # the ids just pushed: the tags that end the reasoning
            return tags
        return self.steer(position, logits, given) if self.steer else logits


def _count(job: Job, t: Any, loaded: Loaded, metrics: Metrics) -> TokenStats:
    """Account one generated token in the job's timings and the metrics."""
    first = t.prefill_seconds is not None and job.completion_tokens == 0
    if first:
        job.prompt_s = float(t.prefill_seconds)
        job.cache_n = int(getattr(t, "reused", 0) or 0)
        metrics.add("prompt_tokens_total", job.prefilled)
        metrics.add("prompt_tokens_reused_total", job.cache_n)
        metrics.add("prompt_seconds_total", job.prompt_s)
    job.completion_tokens += 1
    # the first token's `seconds` includes the prefill, which timings count apart
    seconds = max(0.0, float(t.seconds) - float(t.prefill_seconds or 0.0))
    job.predicted_s += seconds
    metrics.add("tokens_predicted_total")
    metrics.add("tokens_predicted_seconds_total", seconds)
    k3 = k3_record(t, loaded.budget_gb)
    if first:  # the first token's reads are the prefill's
        job.gb_read_prefill = k3.gb_read
    if k3.gb_read:
        metrics.add("gb_read_total", k3.gb_read)
    metrics.set("last_s_per_token", float(t.seconds))
    if k3.true_hit_rate is not None:
        metrics.set("last_true_hit_rate", k3.true_hit_rate)
    return k3


def _decode(
    job: Job,
    gen: Iterator[Any],
    text: _Text,
    loaded: Loaded,
    metrics: Metrics,
    emit: Callable[[Event], None],
) -> str:
    """Emit the tokens of `gen` as text until the end, a stop or the limit: the finish
    reason ("stop", "length" or "cancelled")."""
    finish = "length"
    for t in gen:
        if job.cancel.is_set():
            break
        k3 = _count(job, t, loaded, metrics)
        job.generated.append(int(t.id))
        was_reasoning = text.parser.in_reasoning
        reasoning, content, hit = text.feed(int(t.id))
        if was_reasoning:
            job.reasoning_tokens += 1
        _sent(job, reasoning, content)
        emit(Token(k3, reasoning, content, (int(t.id),)))
        if text.parser.done or hit:
            finish = "stop"
            break
        if job.completion_tokens >= job.max_new:
            break
    if job.cancel.is_set():
        return "cancelled"
    reasoning, content = text.flush()
    if reasoning or content:
        _sent(job, reasoning, content)
        emit(Token(None, reasoning, content))
    return finish


def _sent(job: Job, reasoning: str, content: str) -> None:
    job.reasoning.append(reasoning)
    job.content.append(content)
    job.content_chars += len(content)


def run_job(
    job: Job,
    loaded: Loaded,
    template: ChatTemplate,
    metrics: Metrics,
    steer_demo: bool,
    emit: Callable[[Event], None],
) -> None:
    """Generate for `job`, emitting `Token` events, then `End`, `Failed` or `Stopped`.
    Runs in a worker thread."""
    text = _Text(template, job.req)
    end_ids = list(template.end_ids())
    hook = _Hook(job, loaded.tok, text.parser, end_ids, steer_demo)
    hook.prime(job.partial or [])  # where the answer so far left parser and hook; no text again
    metrics.set("requests_processing", 1)
    gen = None
    try:
        req = job.req
        params = loaded.make_params(
            max_tokens=job.max_new,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop_ids=tuple(end_ids),
        )
        gen = loaded.generate(job.prompt_ids, params, cancel=job.cancel, logits_hook=hook,
                              owner=job.owner, keep_at=job.reply_ends[-1:])
        job.finish = _decode(job, gen, text, loaded, metrics, emit)
        # Closed before the client hears the end: closing keeps the reply's state, and a
        # streamed response that ends sets the cancel, which keeps nothing.
        _close(gen)
        if job.finish == "cancelled":
            metrics.add("requests_cancelled_total")
            emit(Stopped())
        else:
            reply = "".join(job.reasoning), "".join(job.content)
            if job.partial is None and not template.round_trips(
                    job.generated, *reply, thinking=job.req.thinking):
                metrics.add("replies_not_round_trip_total")
            emit(End(job.finish))
    except Exception as exc:  # noqa: BLE001 - reported to the client as an error chunk
        if job.cancel.is_set():
            job.finish = "cancelled"
            metrics.add("requests_cancelled_total")
            emit(Stopped())
        else:
            metrics.add("requests_failed_total")
            if isinstance(exc, EngineError):
                message = str(exc)
            else:
                traceback.print_exc(file=sys.stderr)
                message = f"generation failed: {type(exc).__name__}: {exc}"
            emit(Failed(message))
    finally:
        _close(gen)
        metrics.set("requests_processing", 0)


def _close(gen: Any) -> None:
    """End a generation now (idempotent); the generator keeps its final state on close."""
    if gen is not None and hasattr(gen, "close"):
        try:
            gen.close()
        except Exception:  # noqa: BLE001 - closing a failed generator
            pass


@dataclass(frozen=True)
class LoadSettings:
    """What loading the engine takes from serve's command line, read once (`from_args`)."""

    memory: MemorySettings  # the memory flags, and --snapshot-gb which the plan counts
    debug_token_delay: float = 0.0  # tests: seconds slept after each token
    state_dir: str = ""  # --state-dir: kept states also on disk ("" = in memory only)
    state_gb: float = 0.0  # --state-gb: the state folder's disk budget
    debug_checkpoint_every: int = 0  # tests: a mid-answer checkpoint every N tokens
    debug_hang_after: int = 0  # tests: hold the answer after this many tokens

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadSettings:
        return cls(MemorySettings.from_args(args, snapshot_gb=args.snapshot_gb),
                   args.debug_token_delay, args.state_dir or "", args.state_gb,
                   args.debug_checkpoint_every, args.debug_hang_after)


def _keepers(store: SnapshotStore, owner: str, mids: list[list[int]], kept: list[list[int]]
             ) -> tuple[Callable[[ModelState], None], Callable[[ModelState], None]]:
    """generate's `keep` and `checkpoint` for one answer of `owner`: `kept` gets the ids
    of the states kept, `mids` those of the mid-answer checkpoints (the last two)."""

    def keep(state: ModelState) -> None:
        kept.append(list(state.ids))
        store.put(state, owner=owner)

    def checkpoint(state: ModelState) -> None:
        if store.put(state, owner=owner):
            mids.append(list(state.ids))
            while len(mids) > 2:  # two: the client may be a token behind the newest
                store.drop(mids.pop(0), owner=owner)

    return keep, checkpoint


def load_engine(
    checkpoint: Path,
    tokenizer_dir: Path,
    settings: LoadSettings,
    progress: LoadProgress,
    n_ctx: int,
) -> Loaded:
    """Tokenizer, weight source under the memory plan, model; generation via ENG's API."""
    from engine.decode.generate import GenParams, GenToken, LogitsHook, generate
    from engine.model.transformer import load_model
    from engine.weights.streaming import open_source

    progress.phase = "tokenizer"
    progress.checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    tok = Tokenizer.from_dir(tokenizer_dir)
    progress.phase = "weights"
    source = open_source(checkpoint, settings.memory, context=n_ctx)
    progress.phase = "model"
    model = load_model(checkpoint, source)
    source.warm()  # the pinned layers and tables now, not in the first request's time
    cfg = model.config
    progress.n_layers = getattr(cfg, "num_hidden_layers", None)
    progress.layers_bound = progress.n_layers
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and vocab < tok.vocab_size:
        raise EngineError(
            f"the tokenizer has {tok.vocab_size} ids but the model only {vocab}; "
            "pass --tokenizer with the checkpoint's own tokenizer files"
        )
    plan = getattr(source, "plan", None)
    budget = plan.budget_bytes / 1e9 if plan is not None else None
    memory_plan = (
        {"mode": "streaming", "describe": plan.describe(), **plan.as_dict()}
        if plan is not None
        else {"mode": "resident", "describe": "every weight resident in RAM (no memory flag given)"}
    )
    max_pos = getattr(cfg, "max_position_embeddings", None) or n_ctx

    delay = settings.debug_token_delay
    disk, disk_note = _state_dir(model, checkpoint, settings, n_ctx)
    snapshots, note = _snapshot_store(model, settings.memory.snapshot_gb, n_ctx, disk)

    every = settings.debug_checkpoint_every
    hang = settings.debug_hang_after

    def gen(prompt_ids: list[int], params: GenParams, cancel: threading.Event | None = None,
            logits_hook: LogitsHook | None = None, owner: str = "",
            keep_at: Sequence[int] = ()) -> Iterator[GenToken]:
        resume = snapshots.take(prompt_ids, owner=owner) if snapshots is not None else None
        mids: list[list[int]] = []  # this answer's mid-answer checkpoints, the last two kept
        kept: list[list[int]] = []  # the ids of the states kept by `keep`
        keep = checkpoint = None
        if snapshots is not None:
            keep, checkpoint = _keepers(snapshots, owner, mids, kept)
        run = generate(model, prompt_ids, params, cancel=cancel, logits_hook=logits_hook,
                       resume=resume, keep=keep, keep_at=keep_at,
                       checkpoint=checkpoint, checkpoint_every=every)
        try:
            with contextlib.closing(run):  # closed now, not when collected: it keeps the state
                for token in run:
                    if delay:  # tests: a reply slow enough to stop or kill half-way
                        time.sleep(delay)
                    yield token
                    if hang and token.index + 1 >= hang and cancel is not None:
                        cancel.wait()  # tests: a server killed at a known token
        finally:
            if snapshots is not None and not (cancel is not None and cancel.is_set()):
                for ids in mids:  # the answer ended and its end state is kept (which may
                    if ids not in kept[-1:]:  # be the last checkpoint's ids: not dropped)
                        snapshots.drop(ids, owner=owner)

    return Loaded(
        tok=tok,
        generate=gen,
        make_params=GenParams,
        n_ctx=min(n_ctx, max_pos),
        info={
            "checkpoint": str(checkpoint),
            "memory_plan": _jsonable(memory_plan),
            "meta": {"n_layers": getattr(cfg, "num_hidden_layers", None), "n_vocab_model": vocab},
            "prompt_reuse": {
                "on": snapshots is not None,
                "snapshot_gb": snapshots.budget / 1e9 if snapshots is not None else 0.0,
                "note": note,
                "state_dir": str(disk.root) if disk is not None else None,
                "state_gb": disk.budget / 1e9 if disk is not None else 0.0,
                "state_note": disk_note,
            },
        },
        budget_gb=budget,
        source=source,
        snapshots=snapshots,
    )


def _snapshot_store(model: Any, snapshot_gb: float, n_ctx: int, disk: StateDir | None = None
                    ) -> tuple[SnapshotStore | None, str]:
    """The kept conversation states under `--snapshot-gb` (and in the state folder), or None
    (reuse off) when neither can hold the state of even an empty conversation; and a
    sentence saying so."""
    empty = model.new_state()
    empty.logits = np.zeros(model.config.vocab_size, np.float32)
    smallest = empty.nbytes()
    budget = int(max(snapshot_gb, 0.0) * 1e9)
    if budget < smallest:
        if disk is not None:
            return SnapshotStore(0, disk), "keeps conversation states in the state folder only"
        return None, (
            f"prompt reuse is off: --snapshot-gb {snapshot_gb:g} cannot hold one conversation "
            f"state ({smallest / 1e9:.3g} GB before its latent cache), so every turn is "
            "prefilled from the start; raise --snapshot-gb to turn it on"
        )
    cfg = model.config
    per_token = sum(cfg.mla_latent_width * 4 for i in range(cfg.num_hidden_layers) if cfg.is_mla(i))
    full = smallest + per_token * n_ctx
    return SnapshotStore(budget, disk), (
        f"keeps up to {budget // smallest} conversation states "
        f"({budget // full} at the full {n_ctx}-token context) in {budget / 1e9:.3g} GB, "
        "least recently used dropped first"
    )


def _state_dir(model: Any, checkpoint: Path, settings: LoadSettings, n_ctx: int
               ) -> tuple[StateDir | None, str]:
    """The state folder of `--state-dir` under `--state-gb`, or None and why not."""
    where = settings.state_dir
    if not where:
        return None, "no state folder (--state-dir): kept states end with the process"
    gb = settings.state_gb
    if gb <= 0:
        return None, "--state-gb 0: kept states end with the process"
    fingerprint = checkpoint_fingerprint(checkpoint)
    if fingerprint is None:
        return None, ("the checkpoint has no fingerprint (its trunk layout cannot be "
                      "packed), so states are not kept on disk")
    try:
        disk = StateDir(Path(where).expanduser().absolute(), int(gb * 1e9), fingerprint,
                        model.new_state(), model.config.vocab_size, n_ctx)
    except OSError as exc:
        return None, (f"the state folder {where} cannot be used ({exc.strerror or exc}); "
                      "states are not kept on disk: pass another --state-dir")
    print(f"state folder: {disk.root}, up to {gb:g} GB", file=sys.stderr, flush=True)
    return disk, f"states also kept in {disk.root} (up to {gb:g} GB, least recently used out)"


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
