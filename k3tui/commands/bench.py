"""`k3tui bench WHAT`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

BENCHES = {
    "download": "k3tui.hub.bench",   # k3tui vs hf_hub_download against a loopback hub
    "tui": "k3tui.tui.bench",        # stream 2,000 tokens into the headless app
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", nargs="?", choices=[*BENCHES, "forecast", "engine"],
                        help="download, tui, forecast (the real model's s/token here, from "
                             "measured parts: `k3tui bench forecast --help`), or engine "
                             "(passes the rest to `python -m engine bench`)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options for that benchmark")


def run(args: argparse.Namespace) -> int:
    if args.what is None:  # argparse would name the remainder too: "required: what, rest"
        from k3tui.errors import K3Error

        raise K3Error("Which benchmark? Name one of download, tui, forecast or engine.",
                      "before a download, `k3tui bench forecast` gives the real model's "
                      "s/token on this machine (under a minute)", 2)
    if args.what == "engine":
        return subprocess.call([sys.executable, "-m", "engine", "bench", *args.rest])
    if args.what == "forecast":
        return forecast(args.rest)
    return int(importlib.import_module(BENCHES[args.what]).main(args.rest) or 0)


def forecast(argv: list[str]) -> int:
    """Measure this machine's parts (the engine, as a subprocess), store and print the forecast."""
    from k3tui.planning import forecast as fc

    p = argparse.ArgumentParser(
        prog="k3tui bench forecast",
        description="Forecast the real Kimi-K3's s/token and first-token time per preset on "
                    "this machine from its measured parts (under a minute, nothing downloaded).")
    p.add_argument("--dir", metavar="PATH",
                   help="a folder on the disk where the model would live (default: the "
                        "config's model folder, else k3tui's home)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # tests: toy sizes
    args = p.parse_args(argv)
    result = fc.measure(args.dir or _default_dir(), quick=args.quick)
    path = fc.store(result)
    if args.json:
        print(json.dumps({**result.to_dict(), "stored": str(path), "note": fc.SAYS}))
    else:
        import shutil

        from k3tui.planning.plan import fit_to_width

        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        print(fit_to_width("\n".join(fc.format_forecast(result) + [
            f"Stored in {path} (`k3tui plan` and `k3tui setup` show it)."]), width))
    return 0


def _default_dir() -> str:
    """The config's model folder if it exists yet, else k3tui's home (usually the same disk)."""
    from pathlib import Path

    from k3tui.config import config_exists, load_config
    from k3tui.paths import get_paths, private_dir

    if config_exists():
        d = Path(load_config().model.dir or "").expanduser()
        if str(d) not in ("", ".") and d.is_dir():
            return str(d)
    return str(private_dir(get_paths().root))
