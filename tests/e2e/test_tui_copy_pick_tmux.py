"""Copying an earlier message in the real app in a real tmux: Ctrl+Up / Alt+Up arrive
through tmux, and tmux's own buffer ends up holding what was picked, with tmux's default
settings (the app loads it there itself; its OSC 52 alone needs `set-clipboard on`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from tui_helpers import REPO_ROOT, Tmux

TMUX_ANSWERS = ["One: plain.", "Two:\n\n```sh\necho two\n```\n\nend of two.", "Three: last."]
APP = """
import sys
from pathlib import Path

from k3tui.history import History
from k3tui.tui.app import BackendInfo, ChatApp
from scripted import ScriptedStream

answers = iter({answers!r})


class Stream(ScriptedStream):
    def __call__(self, messages):
        self.content = next(answers)
        return super().__call__(messages)


ChatApp(stream=Stream(""), history=History(Path(sys.argv[1])),
        backend=BackendInfo("bundled", "kimi-k3"), sample_hz=0).run()
"""


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_copy_pick_in_real_tmux_sets_its_buffer(tmp_path):
    """Ctrl+Up / Alt+Up arrive through tmux, and tmux's buffer holds exactly the picked
    answer, its code block, a prompt; `set-clipboard external` (tmux's default) ignores the
    app's own OSC 52, so this is `tmux load-buffer` at work."""
    script = tmp_path / "app.py"
    script.write_text(APP.format(answers=TMUX_ANSWERS))
    env = {"K3TUI_HOME": str(tmp_path / "home"), "TERM": "xterm-256color",
           # the app script imports the scripted backend from tests/support
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests" / "support")])}
    tmux = Tmux(f"k3tui-copy-{os.getpid()}", env)

    def buffer_is(text: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run([*tmux.base, "show-buffer"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout == text:
                return
            time.sleep(0.2)
        raise AssertionError(f"tmux buffer is {out.stdout!r}, not {text!r}\n{tmux.screen()}")

    try:
        tmux.start(f"{sys.executable} {script} {tmp_path / 'history.sqlite3'}")
        subprocess.run([*tmux.base, "set-option", "-s", "set-clipboard", "external"], check=True)
        tmux.wait_for(lambda s: "Stop" in s)  # the footer is drawn
        for prompt, seen in (("first q", "One: plain."), ("second q", "end of two."),
                             ("third q", "Three: last.")):
            tmux.keys(prompt, literal=True)
            tmux.keys("Enter")
            tmux.wait_for(lambda s, seen=seen: seen in s)
        tmux.keys("C-Up", "C-Up", "C-Up")  # answer 3, prompt 3, answer 2
        tmux.wait_for(lambda s: "answer 2 of 3 · ctrl+y copies" in s)
        tmux.keys("C-y")
        tmux.wait_for(lambda s: "Copied answer 2 of 3" in s and "tmux's buffer" in s)
        buffer_is(TMUX_ANSWERS[1])
        tmux.keys("C-g")
        buffer_is("echo two\n")
        tmux.keys("M-Up")  # Alt+Up: prompt 2
        tmux.wait_for(lambda s: "you · prompt 2 of 3" in s)
        tmux.keys("C-y")
        buffer_is("second q")
        tmux.keys("Escape")
        tmux.wait_for(lambda s: "ctrl+y copies" not in s)
        tmux.keys("C-q")
    finally:
        tmux.close()
