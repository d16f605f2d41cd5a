"""Copy text beyond the terminal's own OSC 52: into tmux's buffer and to a local clipboard.

The TUI's Textual App writes the OSC 52 sequence (it asks the *user's* terminal to set its
clipboard, which is what works over SSH). Inside tmux that sequence only reaches tmux, which
takes it when `set -g set-clipboard on`; so the text is also loaded into tmux's buffer with
`tmux load-buffer -w -`, which passes it on to the outer terminal's clipboard with tmux's
default setting too. A local tool (wl-copy, xclip, xsel, pbcopy) is tried as well when a
display is present. No UI imports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping

LOCAL_TOOLS: list[tuple[str, list[str], str]] = [
    ("wl-copy", ["wl-copy"], "WAYLAND_DISPLAY"),
    ("xclip", ["xclip", "-selection", "clipboard"], "DISPLAY"),
    ("xsel", ["xsel", "--clipboard", "--input"], "DISPLAY"),
    ("pbcopy", ["pbcopy"], ""),
]


def _feed(argv: list[str], text: str, env: Mapping[str, str]) -> bool:
    """Run `argv` with `text` on stdin; True when it took it (found, ran, exit 0)."""
    if shutil.which(argv[0], path=env.get("PATH")) is None:
        return False
    try:
        subprocess.run(argv, input=text.encode("utf-8"), timeout=2, check=True, env=dict(env),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def copy_tmux(text: str, env: Mapping[str, str] | None = None) -> bool:
    """Inside tmux: set tmux's buffer and (-w, tmux ≥ 3.2) the outer terminal's clipboard."""
    env = os.environ if env is None else env
    return bool(env.get("TMUX")) and _feed(["tmux", "load-buffer", "-w", "-"], text, env)


def copy_local(text: str, env: Mapping[str, str] | None = None) -> str | None:
    """Copy with a local clipboard tool; returns the tool's name or None."""
    env = os.environ if env is None else env
    for name, argv, needs in LOCAL_TOOLS:
        if needs and not env.get(needs):
            continue
        if name == "pbcopy" and sys.platform != "darwin":
            continue
        if _feed(argv, text, env):
            return name
    return None


def copy_beyond_terminal(text: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The routes besides OSC 52 that accepted the text: "tmux" and/or a local tool's name."""
    routes = ["tmux"] if copy_tmux(text, env) else []
    tool = copy_local(text, env)
    return routes + [tool] if tool else routes
