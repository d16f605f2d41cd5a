"""`python -m engine bench WHICH`: the benchmarks of engine/bench/, each a module with its own
`add_arguments` and `main`, imported only when chosen.

* forward — compute: one KDA layer and one MLA-MoE layer at the real widths, BF16 and
  MXFP4 matmul throughput as fractions of the memory bandwidth measured in the same run
  (engine/bench/forward.py).
* stream — I/O: the streaming source under memory budgets (engine/bench/stream.py).
* parts — this machine's disk and real-width compute, and the real model's forecast per
  preset from them (engine/bench/parts.py).
* slice — the real-width slice under a ladder of budgets, measured against the forecast
  (engine/bench/slice.py).
* serve — the HTTP server's cost per token against calling generate directly
  (engine/bench/serve.py).
* compact — the lossless compact trunk against the BF16 one (engine/bench/compact.py).
* chat — a 4-turn conversation, each turn cold vs resumed from the kept states; with
  --restart through real servers restarted before each turn, and an answer killed halfway
  and continued (engine/bench/chat.py).
* prefill — the multi-token kernels against numpy's FP32 GEMM at real widths, and a prompt
  prefilled whole against token by token (engine/bench/prefill.py).
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "forward": "engine.bench.forward",
    "stream": "engine.bench.stream",
    "serve": "engine.bench.serve",
    "compact": "engine.bench.compact",
    "parts": "engine.bench.parts",
    "slice": "engine.bench.slice",
    "chat": "engine.bench.chat",
    "prefill": "engine.bench.prefill",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHICH", required=True)
    for name, module in BENCHES.items():
        sp = sub.add_parser(
            name, help=(importlib.import_module(module).__doc__ or "").split("\n")[0]
        )
        importlib.import_module(module).add_arguments(sp)


def main(args: argparse.Namespace) -> int:
    return int(importlib.import_module(BENCHES[args.bench]).main(args) or 0)
