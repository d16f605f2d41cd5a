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
