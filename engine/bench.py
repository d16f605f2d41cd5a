"""`python -m engine bench forward|stream`: benchmarks that print ratios measured in one run.

* forward — compute: one KDA layer and one MLA-MoE layer at the real widths, BF16 and
  MXFP4 matmul throughput as fractions of the memory bandwidth measured in the same run
  (engine/bench_forward.py).
* stream — I/O: the streaming source under memory budgets (engine/bench_stream.py).
* parts — this machine's disk and real-width compute, and the real model's forecast per
  preset from them (engine/bench_parts.py).
* slice — the real-width slice under a ladder of budgets, measured against the forecast
  (engine/bench_slice.py).
* serve — the HTTP server's cost per token against calling generate directly
  (engine/bench_serve.py).
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "forward": "engine.bench_forward",
    "stream": "engine.bench_stream",
    "serve": "engine.bench_serve",
    "parts": "engine.bench_parts",
    "slice": "engine.bench_slice",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHICH", required=True)
    for name, module in BENCHES.items():
        sp = sub.add_parser(name, help=(importlib.import_module(module).__doc__ or "").split("\n")[0])
        importlib.import_module(module).add_arguments(sp)


def main(args: argparse.Namespace) -> int:
    return int(importlib.import_module(BENCHES[args.bench]).main(args) or 0)
