"""`k3tui bench WHAT`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

BENCHES = {
    "download": "k3tui.hub.bench",   # k3tui vs hf_hub_download against a loopback hub
    "tui": "k3tui.tui.bench",        # stream 2,000 tokens into the headless app
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=[*BENCHES, "engine"],
                        help="download, tui, or engine (passes the rest to "
                             "`python -m engine bench`)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options for that benchmark")


def run(args: argparse.Namespace) -> int:
    if args.what == "engine":
        return subprocess.call([sys.executable, "-m", "engine", "bench", *args.rest])
    return int(importlib.import_module(BENCHES[args.what]).main(args.rest) or 0)
