"""Decoding loop: prefill, then one token per step (or full recomputation), sampling,
stop ids, max tokens, cancellation, per-token timing and engine statistics."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.decode.sampler import Sampler
from engine.decode.stats import StatsMeter, TokenStats
from engine.model.state import ModelState
from engine.model.transformer import Cancelled, Model

LogitsHook = Callable[[list[int], np.ndarray], np.ndarray]
CHECKPOINT_SHARE = 0.02  # mid-answer checkpoints may cost at most this share of a token


def checkpoint_interval(save_s: float, token_s: float) -> int:
    """Tokens between two mid-answer checkpoints so that a save of `save_s` seconds costs at
    most CHECKPOINT_SHARE of tokens of `token_s` seconds each."""
    if token_s <= 0:
        return 1 << 30
    return max(1, math.ceil(save_s / (CHECKPOINT_SHARE * token_s)))


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    full_recompute: bool = False


@dataclass(frozen=True)
class GenToken:
    id: int
    seconds: float  # wall time since the previous token (since the start for index 0)
    index: int
    prefill_seconds: float | None  # index 0 only: the prompt's forward pass
    stats: TokenStats = field(default_factory=TokenStats)
    stop: bool = False  # this id is one of params.stop_ids; it is the last token yielded
    reused: int = 0  # index 0 only: prompt ids resumed from a snapshot, not prefilled


def generate(model: Model, prompt_ids: Sequence[int], params: GenParams, *,
             cancel: threading.Event | None = None,
             logits_hook: LogitsHook | None = None,
             resume: ModelState | None = None,
             keep: Callable[[ModelState], None] | None = None,
             keep_at: Sequence[int] = (),
             checkpoint: Callable[[ModelState], None] | None = None,
             checkpoint_every: int = 0) -> Generator[GenToken, None, None]:
    """Yield generated tokens one by one. A stop id is yielded (flagged `stop`) and ends the
    run; `cancel` is checked between tokens and between layers.

    `resume`: a state whose ids are a prefix of `prompt_ids` (the caller's own copy: it is
    advanced); only the rest of the prompt is prefilled, and the first token says how many
    ids were reused. `keep` is given the state right after the prompt and again when the run
    ends (the ids it covers are in it), never a state a cancel left half-advanced; and, during
    the prefill, the state after each of the first `keep_at` prompt ids (the prefill split
    there: the ids never depend on the split).

    `checkpoint` is given the state mid-answer (the prompt and the ids so far, with the
    logits to sample the next one from) every `checkpoint_every` tokens, or, when that is
    0, every `checkpoint_interval` tokens by the measured cost of the last save (the keep
    after the prompt, or the last checkpoint) and of the last token."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt id")
    sample = Sampler(params.temperature, params.top_k, params.top_p, params.seed)
    stops = set(int(s) for s in params.stop_ids)
    ids = [int(i) for i in prompt_ids]
    generated: list[int] = []
    state = None if params.full_recompute else _start(model, ids, resume)
    reused = len(state.ids) if state is not None else 0
    meter = StatsMeter(model.source)
    start = last = time.perf_counter()
    whole = False  # the state covers exactly the ids fed so far (no forward cut short)
    save_s, saved_at = None, 0  # the last save's cost, and the index it was made at
    try:
        for index in range(params.max_tokens):
            if cancel is not None and cancel.is_set():
                return
            t0 = time.perf_counter()
            whole = False
            if params.full_recompute:
                logits = model.forward(ids, model.new_state(), all_positions=False, cancel=cancel)[
                    -1
                ]
            elif index == 0:
                done = reused
                for mark in sorted({int(m) for m in keep_at} if keep is not None else ()):
                    if done < mark < len(ids):
                        model.prefill(ids[done:mark], state, cancel=cancel)
                        keep(state.snapshot())
                        done = mark
                rest = ids[done:]
                logits = model.prefill(rest, state, cancel=cancel) if rest else state.logits
                if keep is not None:
                    t1 = time.perf_counter()
                    keep(state.snapshot())
                    save_s = time.perf_counter() - t1
            else:
                logits = model.step(ids[-1], state, cancel=cancel)
            whole = True
            compute = time.perf_counter() - t0
            if checkpoint is not None and index > 0 and index - saved_at >= (
                    checkpoint_every or (1 if save_s is None
                                         else checkpoint_interval(save_s, compute))):
                t1 = time.perf_counter()
                checkpoint(state.snapshot())
                save_s, saved_at = time.perf_counter() - t1, index
            if logits_hook is not None:
                logits = logits_hook(list(generated), logits)
            token = sample(logits, position=len(ids))  # the id at ids[len(ids)]
            seconds = time.perf_counter() - (start if index == 0 else last)
            generated.append(token)
            ids.append(token)
            yield GenToken(
                id=token,
                seconds=seconds,
                index=index,
                prefill_seconds=compute if index == 0 else None,
                stats=meter.delta(seconds, compute),
                stop=token in stops,
                reused=reused if index == 0 else 0,
            )
            last = time.perf_counter()
            if token in stops:
                return
    except Cancelled:
        return
    finally:
        cancelled = cancel is not None and cancel.is_set()
        if keep is not None and state is not None and whole and not cancelled:
            keep(state.snapshot())  # trimmed: the latent cache grows by doubling


def _start(model: Model, ids: list[int], resume: ModelState | None) -> ModelState:
    """The state to prefill from: `resume` when it covers a prefix of `ids` (and, if it
    covers all of them, has the logits to sample from), else a fresh one."""
    if resume is not None:
        n = len(resume.ids)
        if resume.ids == ids[:n] and (n < len(ids) or resume.logits is not None):
            return resume
    return model.new_state()
