"""`k3tui completion bash|zsh|fish`: a completion script generated from the real parser
(by shtab), so every subcommand, flag and choice is completed as `--help` shows it."""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh", "fish")
HOW = {
    "bash": "add `eval \"$(k3tui completion bash)\"` to ~/.bashrc",
    "zsh": "run `k3tui completion zsh > ~/.zfunc/_k3tui` with ~/.zfunc in $fpath "
           "before `compinit`",
    "fish": "run `k3tui completion fish > ~/.config/fish/completions/k3tui.fish`",
}


def machine_completion() -> dict:
    """shtab's `.complete` for `--machine`: a built-in profile's name, or a report file
    (`k3tui doctor --json`). Names are written into the script when it is generated."""
    from k3tui.probe.report import list_profiles

    names = " ".join(list_profiles())
    return {
        "bash": "_k3tui_machines",
        "zsh": f"_alternative 'profiles:machine profile:({names})' 'files:report file:_files'",
        "fish": f"{names} (__fish_complete_path (commandline -ct))",
        "preamble": {"bash": ("_k3tui_machines() {\n"
                              f"  compgen -W '{names}' -- \"$1\"\n"
                              "  compgen -f -- \"$1\"\n}\n")},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shell", choices=SHELLS,
                        help="; ".join(f"{shell}: {how}" for shell, how in HOW.items()))


def run(args: argparse.Namespace) -> int:
    from k3tui.cli import build_parser
    from k3tui.errors import K3Error

    try:
        import shtab
    except ImportError:
        raise K3Error("shell completion needs the shtab package, which is not installed.",
                      "pip install 'shtab==1.13.0' (k3tui's install brings it)") from None
    print(shtab.complete(build_parser(full=True), shell=args.shell), end="")
    return 0
