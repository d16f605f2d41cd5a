"""`python -m engine plan --model real|DIR --preset NAME`: the memory plan, without weights.

`--model real` plans the released 93-layer Kimi-K3 from its geometry, `--model DIR` a
checkpoint on disk from its headers (engine/weights/geometry.py). The plan is printed as a
forecast for any machine: it is not refused for lack of memory here (`fits_here` says
whether it would be).
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.errors import EngineError
from engine.weights.geometry import plan_for
from k3vocab import DEFAULT_CONTEXT, PRESET_CHOICES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="real", metavar="real|DIR",
                        help="'real' (the released 93-layer model, from its geometry) or a "
                        "checkpoint folder")
    parser.add_argument("--preset", choices=PRESET_CHOICES, default=None)
    parser.add_argument("--budget-gb", type=float, default=None, metavar="X")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, metavar="N")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def main(args: argparse.Namespace) -> int:
    if args.preset is None and args.budget_gb is None:
        args.preset = "laptop"
    if args.context < 1:
        print("error: --context must be at least 1 token.", file=sys.stderr)
        return 2
    try:
        plan = plan_for(args.model, args.preset, args.budget_gb, args.context)
    except (EngineError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    avail = plan.facts.available if plan.facts else 0
    fits = bool(avail) and plan.forecast_rss_bytes <= 0.95 * avail
    if args.json:
        print(json.dumps({"model": args.model, "source": plan.source, **plan.as_dict(),
                          "context": plan.context, "fits_here": fits}))
        return 0
    print(plan.describe())
    print(f"  reads per token: {plan.read_bytes_per_token / 1e9:.2f} GB of trunk/head + "
          f"expert misses; fits in this machine's memory: {'yes' if fits else 'no'}")
    return 0
