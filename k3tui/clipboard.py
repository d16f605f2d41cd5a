"""Copy text over SSH (OSC 52, wrapped for tmux) and to the local clipboard if there is one.

OSC 52 asks the *user's* terminal to set its clipboard, which is what works over SSH.
Inside tmux it is sent twice: plain, which tmux takes into its own buffer and forwards to
the outer terminal when `set -g set-clipboard on`; and wrapped in a DCS passthrough, which
tmux hands straight to the outer terminal when `allow-passthrough on` (or tmux < 3.3).
Either setting is enough. A local tool (wl-copy, xclip, xsel, pbcopy) is tried as well
when a display is present. No UI imports.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping

LOCAL_TOOLS: list[tuple[str, list[str], str]] = [
    ("wl-copy", ["wl-copy"], "WAYLAND_DISPLAY"),
    ("xclip", ["xclip", "-selection", "clipboard"], "DISPLAY"),
    ("xsel", ["xsel", "--clipboard", "--input"], "DISPLAY"),
    ("pbcopy", ["pbcopy"], ""),
]


def osc52_sequence(text: str, env: Mapping[str, str] | None = None) -> str:
    """The escape sequence that sets the terminal clipboard; in tmux, plain then wrapped."""
    env = os.environ if env is None else env
    payload = base64.b64encode(text.encode("utf-8")).decode("ascii")
    seq = f"\x1b]52;c;{payload}\x07"
    if env.get("TMUX"):
        # tmux's default (set-clipboard external) drops the plain one and allow-passthrough
        # off drops the wrapped one (DCS passthrough: every ESC inside is doubled).
        seq += "\x1bPtmux;" + seq.replace("\x1b", "\x1b\x1b") + "\x1b\\"
    return seq


def copy_local(text: str, env: Mapping[str, str] | None = None) -> str | None:
    """Copy with a local clipboard tool; returns the tool's name or None."""
    env = os.environ if env is None else env
    for name, argv, needs in LOCAL_TOOLS:
        if needs and not env.get(needs):
            continue
        if name == "pbcopy" and sys.platform != "darwin":
            continue
        if shutil.which(argv[0]) is None:
            continue
        try:
            subprocess.run(argv, input=text.encode("utf-8"), timeout=2, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return name
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def copy(text: str, *, write: Callable[[str], None] | None = None, tty_path: str = "/dev/tty",
         env: Mapping[str, str] | None = None, local: bool = True) -> list[str]:
    """Copy by every route available; returns the routes that accepted the text.

    `write` sends the OSC 52 sequence through the caller's terminal writer (the TUI's
    driver, so it does not interleave with a frame); otherwise it goes to `tty_path`.
    """
    routes: list[str] = []
    seq = osc52_sequence(text, env)
    try:
        if write is not None:
            write(seq)
        else:
            with open(tty_path, "w", encoding="ascii") as tty:
                tty.write(seq)
                tty.flush()
        routes.append("osc52")
    except OSError:
        pass
    if not local:
        return routes
    tool = copy_local(text, env)
    if tool:
        routes.append(tool)
    return routes
