"""The subcommands: each module has `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import sys


def old_spelling(parser: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    """`old` still works as `new` (hidden from --help) and says once that it was renamed:
    `--model` meant a checkpoint kind, a path or a name depending on the subcommand."""

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"k3tui: note: {old} is now {new} here; {old} will go away.",
                  file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, action=Renamed, help=argparse.SUPPRESS, **kwargs)
