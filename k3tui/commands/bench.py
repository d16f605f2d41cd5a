"""`k3tui bench`: not built yet."""

from __future__ import annotations

import argparse

from k3tui.errors import K3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise K3Error("`k3tui bench` is not built yet.", "see the README for what works today", 2)
