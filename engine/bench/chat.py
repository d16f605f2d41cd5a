"""`python -m engine bench chat`: a scripted 4-turn conversation, each turn's prompt
prefilled cold (a fresh state) and resumed from the server's kept states (prefix reuse,
engine/serve/snapshots.py), interleaved turn by turn in one run, under a streaming budget
and resident. Per turn: prompt tokens, tokens prefilled, GB read during the prefill, time
to first token, and the ratio cold ÷ reuse. Each side has its own weight source (its own
expert cache); which side runs first alternates per turn.

--restart: the same 4 turns through real `python -m engine serve` processes, in turn: one
restarted before each turn with its states in a state folder, one kept running, one cold
(`--snapshot-gb 0`), the ids of all three compared; then one answer killed with SIGKILL
halfway and continued in partial mode by a restarted server (the tokens it prefilled, and
whether the ids equal the uninterrupted run's).

Checkpoint: --checkpoint, else the bench one if `bench stream` synthesised it already,
else a small one synthesised in a temporary folder (it still streams under the budget).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.bench.stream import default_workdir
from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
from engine.errors import EngineError
from engine.model.transformer import load_model
from engine.serve.snapshots import SnapshotStore
from engine.text.chat_template import CLOSE, END_OF_MSG, SEP, ChatTemplate
from engine.text.tokenizer import Tokenizer
from engine.weights.planner import make_plan
from engine.weights.streaming import CheckpointMap, StreamingSource
from k3vocab import GB

QUESTIONS = (
    "What is a mixture of experts?",
    "And how many experts does each token use?",
    "Why does that make streaming from disk possible?",
    "Summarise the whole conversation in one line.",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="an existing checkpoint")
    parser.add_argument("--reply-tokens", type=int, default=12, metavar="N",
                        help="tokens generated per reply (default 12)")
    parser.add_argument("--budget-factor", type=float, default=1.5, metavar="F",
                        help="the streaming budget as a multiple of the checkpoint's minimum")
    parser.add_argument("--restart", action="store_true",
                        help="real servers: one restarted before each turn (its states on "
                        "disk), one kept running, one cold; and an answer killed halfway")
    parser.add_argument("--checkpoint-every", type=int, default=4, metavar="N",
                        help="--restart: mid-answer checkpoints every N tokens (default 4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _checkpoint(args: argparse.Namespace, tmp: Path) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)

    bench = default_workdir() / "ck-bench-seed0"
    if (bench / ".complete").is_file():
        return bench

    return synthesize(tmp, "small", seed=0)


def _models(ck: Path, budget_gb: float | None):
    """Two models over their own sources (cold, reuse): resident, or streaming."""
    if budget_gb is None:
        return load_model(ck), load_model(ck)
    out = []
    for _ in range(2):
        cmap = CheckpointMap(ck)
        out.append(load_model(ck, StreamingSource(cmap, make_plan(cmap.geometry(),
                                                                  budget_gb=budget_gb))))
    return tuple(out)


def _first(gen) -> tuple[object, list[int]]:
    first, ids = None, []
    for t in gen:
        first = first or t
        ids.append(t.id)
    return first, ids


def _conversation(ck: Path, budget_gb: float | None, reply_tokens: int) -> list[dict]:
    tpl = ChatTemplate(Tokenizer.from_dir(ck))
    cold_model, reuse_model = _models(ck, budget_gb)
    store = SnapshotStore(1 << 40)
    params = GenParams(max_tokens=reply_tokens, stop_ids=tpl.end_ids())
    system = tpl.render([], add_generation_prompt=False)  # the thinking-effort message
    closing = ([tpl.control_ids[CLOSE]] + tpl.tok.encode("message")
               + [tpl.control_ids[SEP], tpl.control_ids[END_OF_MSG]])
    prompt: list[int] = []
    rows = []
    for n, question in enumerate(QUESTIONS):
        user = tpl.render([{"role": "user", "content": question}])[len(system):]
        prompt = (system if n == 0 else prompt + closing) + user

        def cold():
            return _first(generate(cold_model, prompt, GenParams(max_tokens=1)))[0]

        def reuse():
            return _first(generate(reuse_model, prompt, params, resume=store.take(prompt),
                                   keep=store.put))

        if n % 2:
            (r, reply), c = reuse(), cold()
        else:
            c = cold()
            r, reply = reuse()
        side = {}
        for name, t in (("cold", c), ("reuse", r)):
            side[name] = {"prefilled": len(prompt) - t.reused, "gb_read": t.stats.gb_read or 0.0,
                          "ttft_s": t.seconds}
        rows.append({"turn": n + 1, "prompt_tokens": len(prompt), **side,
                     "same_first_id": c.id == r.id,
                     "ratio": side["cold"]["ttft_s"] / max(side["reuse"]["ttft_s"], 1e-9)})
        prompt = prompt + reply
    return rows


def main(args: argparse.Namespace) -> int:
    if args.restart:
        try:
            return _restart_main(args)
        except EngineError as exc:  # a checkpoint that cannot be used says what to do itself
            print(f"bench chat --restart: {exc}", file=sys.stderr)
            return 1
        except (RuntimeError, httpx.HTTPError) as exc:
            print(f"bench chat --restart stopped: {exc}; run `python -m engine serve` on the "
                  "checkpoint by hand to see why.", file=sys.stderr)
            return 1
    with tempfile.TemporaryDirectory(prefix="k3-bench-chat-") as tmp:
        ck = _checkpoint(args, Path(tmp))
        g = CheckpointMap(ck).geometry()
        floor = (max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB
        budget = round(floor * args.budget_factor, 3)
        t0 = time.perf_counter()
        result = {
            "checkpoint": str(ck),
            "checkpoint_gb": g.checkpoint_bytes / GB,
            "loadavg_before": os.getloadavg(),
            "modes": {f"streaming {budget:g} GB": _conversation(ck, budget, args.reply_tokens),
                      "resident": _conversation(ck, None, args.reply_tokens)},
            "seconds": time.perf_counter() - t0,
            "loadavg_after": os.getloadavg(),
        }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"bench chat: {ck} ({result['checkpoint_gb']:.2f} GB), load "
          f"{' '.join(f'{x:.2f}' for x in result['loadavg_before'])} -> "
          f"{' '.join(f'{x:.2f}' for x in result['loadavg_after'])} (its own threads count in it)")
    for mode, rows in result["modes"].items():
        print(f"\n{mode}: turn  prompt  prefilled cold/reuse  GB read cold/reuse  "
              "TTFT s cold/reuse  cold/reuse  same 1st id")
        for r in rows:
            c, u = r["cold"], r["reuse"]
            print(f"  {r['turn']:>4}  {r['prompt_tokens']:>6}  {c['prefilled']:>9} / "
                  f"{u['prefilled']:<8}  {c['gb_read']:>7.4g} / {u['gb_read']:<7.4g}  "
                  f"{c['ttft_s']:>7.3f} / {u['ttft_s']:<7.3f}  {r['ratio']:>8.1f}x  "
                  f"{r['same_first_id']}")
    return 0


# --- --restart: real servers, the state folder, a restart before each turn -------------------

SAMPLING = {"temperature": 0.9, "seed": 5}  # sampled: the ids depend on every logit
PATHS = ("restarted", "in-memory", "cold")
CHAT = "/v1/chat/completions"


class _Server:
    """A real `python -m engine serve` on 127.0.0.1, ready when constructed."""

    def __init__(self, ck: Path, *flags: str):
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", str(ck), "--port", "0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        line = self.proc.stdout.readline()
        if not line.startswith("listening on http://"):
            self.kill()
            raise RuntimeError(f"the engine server did not start ({line.strip() or 'no output'})")
        self.url = line.split()[-1]
        try:
            while httpx.get(self.url + "/health", timeout=60).status_code != 200:
                if self.proc.poll() is not None:
                    raise RuntimeError("the engine server exited while loading")
                time.sleep(0.05)
        except BaseException:
            self.kill()
            raise
        self.start_s = time.perf_counter() - t0

    def kill(self) -> None:
        """SIGKILL: nothing is flushed or saved on the way out."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _ask(srv: _Server, body: dict, stop_after: int = 0) -> dict:
    """A streamed answer: its ids and text, the final timings and k3, and the time from the
    request to the first chunk carrying an id. `stop_after`: return once that many ids
    have come, the stream still open (for a kill)."""
    out = {"ids": [], "reasoning": "", "content": "", "ttft_s": None, "timings": {}, "k3": {}}
    t0 = time.perf_counter()
    with httpx.stream("POST", srv.url + CHAT, json={**body, "stream": True},
                      timeout=600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"the server answered {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            ids = chunk.get("k3", {}).get("token_ids") or []
            if ids and out["ttft_s"] is None:
                out["ttft_s"] = time.perf_counter() - t0
            out["ids"] += ids
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                out["reasoning"] += delta.get("reasoning_content") or ""
                out["content"] += delta.get("content") or ""
            if "timings" in chunk:
                out["timings"], out["k3"] = chunk["timings"], chunk["k3"]
            if stop_after and len(out["ids"]) >= stop_after:
                return out
    return out


def _reply(a: dict, partial: bool = False) -> dict:
    msg = {"role": "assistant", "reasoning_content": a["reasoning"], "content": a["content"],
           "k3_token_ids": a["ids"]}
    return {**msg, "partial": True} if partial else msg


def _side(a: dict) -> dict:
    return {"prefilled": a["timings"]["prompt_n"], "reused": a["timings"]["cache_n"],
            "gb_read": a["k3"].get("gb_read_prefill") or 0.0, "ttft_s": a["ttft_s"],
            "ids": a["ids"]}


def _restart_turns(ck: Path, flags: list[str], tmp: Path, reply_tokens: int) -> list[dict]:
    """The 4 turns through three paths in turn (which goes first rotates): a server with a
    state folder started before each turn and killed after it, one server kept running
    (its states in memory), one without kept states. The conversation carries the
    restarted path's replies, with their ids; each path's ids are compared with them."""
    states = tmp / "states"
    memory = _Server(ck, *flags)
    cold = _Server(ck, *flags, "--snapshot-gb", "0")
    messages: list[dict] = []
    rows = []
    try:
        for n, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            body = {"messages": messages, "max_tokens": reply_tokens, **SAMPLING}
            got, start_s = {}, 0.0
            for path in PATHS[n % 3:] + PATHS[:n % 3]:
                if path == "restarted":
                    srv = _Server(ck, *flags, "--state-dir", str(states))
                    start_s = srv.start_s
                    try:
                        got[path] = _ask(srv, body)
                    finally:
                        srv.kill()
                else:
                    got[path] = _ask(memory if path == "in-memory" else cold, body)
            sides = {p: _side(got[p]) for p in PATHS}
            want = sides["restarted"]["ids"]
            rows.append({
                "turn": n + 1, "prompt_tokens": sides["cold"]["prefilled"],
                **sides, "restart_s": start_s,
                "same_ids": all(s["ids"] == want for s in sides.values()),
                "ratio_restarted": sides["cold"]["ttft_s"] / sides["restarted"]["ttft_s"],
                "ratio_in_memory": sides["cold"]["ttft_s"] / sides["in-memory"]["ttft_s"],
            })
            messages.append(_reply(got["restarted"]))
    finally:
        memory.kill()
        cold.kill()
    return rows


def cut_after_text(tok: Tokenizer, ids: list[int], at_least: int) -> int:
    """The first k >= at_least whose k-th id brings text: a stream has sent all k ids by
    then (an id that brings none waits for the next chunk)."""
    parser = ChatTemplate(tok).parser(thinking=True)
    for k, i in enumerate(ids, 1):
        delta = parser.feed(i)
        if k >= at_least and (delta.reasoning or delta.content):
            return k
    raise RuntimeError("the uninterrupted answer brings no text after its middle")


def _killed(ck: Path, flags: list[str], tmp: Path, n: int, every: int) -> dict:
    """One answer of n tokens killed with SIGKILL halfway (the server holds it at token k,
    checkpointing every `every` tokens), then continued in partial mode with its ids by a
    restarted server: the tokens it prefilled, and whether the continued ids are the
    uninterrupted run's."""
    states = tmp / "killed-states"
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": n,
            "ignore_eos": True, **SAMPLING}
    ref = _Server(ck, *flags, "--snapshot-gb", "0")
    try:
        whole = _ask(ref, body)
    finally:
        ref.kill()
    k = cut_after_text(Tokenizer.from_dir(ck), whole["ids"], n // 2)
    srv = _Server(ck, *flags, "--state-dir", str(states), "--debug-checkpoint-every",
                  str(every), "--debug-hang-after", str(k))
    try:
        cut = _ask(srv, body, stop_after=k)  # the server holds the answer at token k
    finally:
        srv.kill()
    again = _Server(ck, *flags, "--state-dir", str(states))
    try:
        rest = _ask(again, {**body, "messages": body["messages"] + [_reply(cut, partial=True)],
                            "max_tokens": n - k})
    finally:
        again.kill()
    return {"tokens": n, "killed_after": len(cut["ids"]), "checkpoint_every": every,
            "prompt_tokens": rest["timings"]["prompt_n"] + rest["timings"]["cache_n"],
            "prefilled": rest["timings"]["prompt_n"], "reused": rest["timings"]["cache_n"],
            "same_ids": cut["ids"] + rest["ids"] == whole["ids"]}


def _restart_main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="k3-bench-chat-") as tmp:
        ck = _checkpoint(args, Path(tmp))
        g = CheckpointMap(ck).geometry()
        floor = (max(g.layer_bytes) + g.min_expert_slots * g.expert_slot_bytes) / GB
        budget = round(floor * args.budget_factor, 3)
        flags = ["--budget-gb", f"{budget:g}"]
        t0 = time.perf_counter()
        load = os.getloadavg()
        turns = _restart_turns(ck, flags, Path(tmp), args.reply_tokens)
        killed = _killed(ck, flags, Path(tmp), 2 * args.reply_tokens, args.checkpoint_every)
        result = {"checkpoint": str(ck), "checkpoint_gb": g.checkpoint_bytes / GB,
                  "budget_gb": budget, "loadavg_before": load, "turns": turns,
                  "killed": killed, "seconds": time.perf_counter() - t0,
                  "loadavg_after": os.getloadavg()}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"bench chat --restart: {ck} ({result['checkpoint_gb']:.2f} GB) streaming under "
          f"{budget:g} GB, load {' '.join(f'{x:.2f}' for x in load)} -> "
          f"{' '.join(f'{x:.2f}' for x in result['loadavg_after'])}, "
          f"{result['seconds']:.0f} s")
    print("turn  prompt  prefilled rst/mem/cold  GB read rst/mem/cold      "
          "TTFT s rst/mem/cold     cold÷rst cold÷mem  restart s  same ids")
    for r in turns:
        s = [r[p] for p in PATHS]
        print(f"{r['turn']:>4}  {r['prompt_tokens']:>6}  "
              f"{'/'.join(str(x['prefilled']) for x in s):>20}  "
              f"{'/'.join(format(x['gb_read'], '.4g') for x in s):>22}  "
              f"{'/'.join(format(x['ttft_s'], '.3f') for x in s):>22}  "
              f"{r['ratio_restarted']:>7.1f}x {r['ratio_in_memory']:>7.1f}x  "
              f"{r['restart_s']:>9.1f}  {r['same_ids']}")
    k = killed
    print(f"killed with SIGKILL after {k['killed_after']} of {k['tokens']} tokens (checkpoints "
          f"every {k['checkpoint_every']}), continued by a restarted server in partial mode: "
          f"prefilled {k['prefilled']} of {k['prompt_tokens']} prompt tokens; continued ids "
          f"equal the uninterrupted run's: {k['same_ids']}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
