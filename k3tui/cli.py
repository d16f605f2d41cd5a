"""`k3tui` entry point.

Each subcommand lives in `k3tui/commands/<name>.py` and exposes `add_arguments(parser)`
and `run(args) -> int`. Only the chosen subcommand's module is imported, so `k3tui --help`
stays fast and never pulls in numpy, textual or huggingface_hub.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from k3tui import __version__
from k3tui.errors import K3Error

COMMANDS: dict[str, str] = {
    "setup": "probe this machine, choose a backend and preset, write the config",
    "doctor": "check this machine and the model files; say what to do next",
    "plan": "show what k3tui would run on a machine (or size a cluster with --users)",
    "download": "download a checkpoint: resumable, verified, survives a dropped SSH session",
    "pack": "pack the trunk of a safetensors checkpoint for streaming",
    "chat": "open the chat (try --demo first)",
    "serve": "start the configured backend as an OpenAI-compatible server",
    "worker": "lend this machine's memory to a head's pool (a llama.cpp RPC worker)",
    "jobs": "list, attach to or cancel detached jobs (downloads, packing)",
    "bench": "measure: download, tui, engine",
    "config": "show the config and where k3tui keeps its files",
    "completion": "print a shell completion script: bash, zsh or fish",
}


def build_parser(command: str | None = None, full: bool = False) -> argparse.ArgumentParser:
    """The parser, with the arguments of `command` only (fast), or of every one (`full`:
    what shell completion is generated from)."""
    parser = argparse.ArgumentParser(
        prog="k3tui",
        description="Run Kimi-K3 (2.78 T parameters) on the machine you have.",
        epilog="Start with `k3tui chat --demo`, then `k3tui setup`.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"k3tui {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if full or name == command:
            importlib.import_module(f"k3tui.commands.{name}").add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(f"k3tui.commands.{args.command}")
    try:
        from k3tui.paths import secure_home

        secure_home()  # what an older k3tui (or a loose umask) left readable by others
        return int(module.run(args) or 0)
    except K3Error as exc:
        print(f"k3tui: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\nk3tui: interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `k3tui plan | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
