"""`python -m engine pack CHECKPOINT OUT [--compact] [--verify]`: pack a checkpoint's trunk
into trunk.bin + trunk.json (engine/checkpoint/trunk.py), resumably, or only check one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from engine.checkpoint.trunk import pack, repack_in_place, verify
from engine.errors import EngineError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (safetensors shards + config)")
    parser.add_argument("out", help="folder for trunk.bin + trunk.json (resumes if present; "
                        "a finished trunk is checked and what changed re-packed)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    parser.add_argument("--compact", action="store_true",
                        help="write the lossless compact trunk (~12 bits/weight, this engine "
                        "only) instead of the peer-compatible BF16 one")
    parser.add_argument("--verify", action="store_true",
                        help="only check every layer of the finished trunk against its digest "
                        "and the checkpoint; change nothing (exit 1 on a mismatch)")


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    last = [0.0]
    verb = "checking" if args.verify else "packing"

    def show(done: int, total: int, layer: int) -> None:
        now = time.perf_counter()
        if now - last[0] < 0.5 and done < total:
            return
        last[0] = now
        rate = done / 1e6 / max(now - t0, 1e-9)
        print(f"\r{verb} layer {layer}: {done / 1e9:.2f} / {total / 1e9:.2f} GB "
              f"({100 * done / max(total, 1):.0f}%), {rate:.0f} MB/s", end="",
              file=sys.stderr, flush=True)

    try:
        if args.verify:
            summary = verify(args.checkpoint, args.out, progress=show)
        else:
            summary = pack(args.checkpoint, args.out, progress=show,
                           compact=args.compact)
    except EngineError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    print(file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    elif args.verify:
        print(verdict(summary, Path(args.checkpoint), Path(args.out)))
    elif summary["already_packed"]:
        print(f"{args.out} already holds this checkpoint's trunk (every layer checked); "
              "nothing to do.")
    else:
        kind = (f"compact trunk ({100 * summary['ratio']:.1f}% of its BF16 size)"
                if "ratio" in summary else "trunk")
        print(f"packed {summary['total_bytes'] / 1e9:.3f} GB of {kind} into {args.out} "
              f"({summary['mb_per_s']:.0f} MB/s).")
    return 1 if args.verify and summary["bad"] else 0


def verdict(summary: dict[str, Any], checkpoint_dir: Path, trunk_dir: Path) -> str:
    """verify()'s result in one sentence."""
    bad = summary["bad"]
    if not bad:
        return (f"every layer of the trunk in {trunk_dir} matches its digest and the checkpoint "
                f"({summary['bytes'] / 1e9:.3f} GB read in {summary['seconds']:.1f} s).")
    layer, why = bad[0]
    more = f" (and {len(bad) - 1} more layers)" if len(bad) > 1 else ""
    return (f"layer {layer} of the trunk in {trunk_dir} does not match: {why}{more}; "
            f"{repack_in_place(checkpoint_dir, trunk_dir)}.")
