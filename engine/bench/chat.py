"""`python -m engine bench chat`: a scripted 4-turn conversation, each turn's prompt
prefilled cold (a fresh state) and resumed from the server's kept states (prefix reuse,
engine/serve/snapshots.py), interleaved turn by turn in one run, under a streaming budget
and resident. Per turn: prompt tokens, tokens prefilled, GB read during the prefill, time
to first token, and the ratio cold ÷ reuse. Each side has its own weight source (its own
expert cache); which side runs first alternates per turn.

Checkpoint: --checkpoint, else the bench one if `bench stream` synthesised it already,
else a small one synthesised in a temporary folder (it still streams under the budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from engine.bench.stream import default_workdir
from engine.checkpoint.synth import synthesize
from engine.decode.generate import GenParams, generate
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


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
