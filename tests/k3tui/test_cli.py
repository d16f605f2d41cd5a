"""The CLI's shape: every subcommand listed, and `--help` stays light."""

from __future__ import annotations

import json
import subprocess
import sys

from k3tui.cli import COMMANDS


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "k3tui", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in ["setup", "doctor", "plan", "download", "pack", "chat", "serve", "jobs",
                 "bench", "config"]:
        assert name in COMMANDS
        assert f"    {name}" in out


def test_help_imports_no_heavy_modules():
    code = ("import sys, contextlib, io\n"
            "from k3tui.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
            "import json; print(json.dumps(sorted(m for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    loaded = set(json.loads(out))
    for heavy in ["numpy", "textual", "huggingface_hub", "rich", "questionary", "httpx"]:
        assert heavy not in loaded, heavy


def test_a_mistyped_flag_gets_its_subcommands_usage_and_the_nearest_flag():
    """`k3tui chat --dmeo` printed the top-level usage (`k3tui [-h] [-V] COMMAND ...`),
    which names no chat flag at all."""
    res = subprocess.run([sys.executable, "-m", "k3tui", "chat", "--dmeo"], capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("usage: k3tui chat ") and "--demo" in res.stderr
    assert res.stderr.rstrip().endswith(
        "k3tui chat: error: unrecognized arguments: --dmeo (did you mean --demo?)")
    top = subprocess.run([sys.executable, "-m", "k3tui", "--bogus"], capture_output=True,
                         text=True, timeout=60)
    assert top.returncode == 2 and "usage: k3tui [-h]" in top.stderr
