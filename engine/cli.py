"""`python -m engine COMMAND`: run, synth, pack, serve, plan, bench (the dispatcher that
__main__.py calls).

Each command's module (engine/commands/) exposes
`add_arguments(parser)` and `main(args) -> int`; only the chosen one is imported, so
`--help` and a command's start-up never pay for the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "run": ("engine.commands.run",
            "generate from a checkpoint (token ids in, ids and timings out)"),
    "synth": ("engine.commands.synth", "write a random-weight Kimi-K3-architecture checkpoint"),
    "pack": ("engine.commands.pack", "pack a checkpoint's trunk into trunk.bin + trunk.json"),
    "serve": ("engine.commands.serve", "serve a checkpoint over an OpenAI-compatible HTTP API"),
    "plan": ("engine.commands.plan", "the memory plan and its forecast, without weights"),
    "bench": ("engine.commands.bench", "benchmarks: forward, stream, serve, compact, parts, slice"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(sp)
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted.", file=sys.stderr)
        return 130
