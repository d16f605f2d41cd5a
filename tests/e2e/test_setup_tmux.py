"""`k3tui setup` in a real terminal (tmux) as a user runs it: the recommendation accepted
through to a written config, and Ctrl-C at the first question changing nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


def _tmux(*args):
    return subprocess.run(["tmux", *args], capture_output=True, text=True)


def _wait_for(session, *texts, timeout=60.0):
    """The screen once any of `texts` shows (a question wrapped at the edge counts)."""
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = _tmux("capture-pane", "-p", "-t", session, "-S", "-200").stdout
        words = " ".join(screen.split())
        if any(t in screen or t in words for t in texts):
            return screen
        time.sleep(0.1)
    raise AssertionError(f"{texts!r} never appeared; screen:\n{screen}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("cancel", [False, True])
def test_setup_in_tmux(tmp_path, _isolated_home, cancel):
    session = f"k3fnd-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "run.sh"
    script.write_text(
        f"export K3TUI_HOME={_isolated_home} HOME={tmp_path} HF_HOME={tmp_path}/hf\n"
        f"unset HF_TOKEN\ncd {Path.cwd()}\n"
        f"{sys.executable} -m k3tui setup\necho EXIT=$?\nsleep 60\n")
    _tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "50", f"bash {script}")
    try:
        _wait_for(session, "Which checkpoint?")
        if cancel:
            _tmux("send-keys", "-t", session, "C-c")
            screen = _wait_for(session, "EXIT=")
            assert "no changes were made" in screen and "EXIT=130" in screen
            assert not (_isolated_home / "config.toml").exists()
            return
        _tmux("send-keys", "-t", session, "Enter")  # the recommendation (no GPU: safetensors)
        _wait_for(session, "Where should the checkpoint go?")
        _tmux("send-keys", "-t", session, "Enter")
        screen = _wait_for(session, "Choose another folder?", "Measure what the real model")
        if "Choose another folder?" in screen:  # this VM's disk is far below 1.56 TB
            assert "not enough disk" in screen
            _tmux("send-keys", "-t", session, "n", "Enter")
        _wait_for(session, "Measure what the real model would do")  # not now: under a minute
        _tmux("send-keys", "-t", session, "n", "Enter")
        _wait_for(session, "Hugging Face token")
        _tmux("send-keys", "-t", session, "Enter")
        _wait_for(session, "Engine memory preset:")
        _tmux("send-keys", "-t", session, "Enter")
        _wait_for(session, "Write this to")
        _tmux("send-keys", "-t", session, "y", "Enter")
        screen = _wait_for(session, "EXIT=")
        assert "EXIT=0" in screen and "Config written" in screen and "k3tui download" in screen
        text = (_isolated_home / "config.toml").read_text()
        assert 'kind = "safetensors"' in text and 'kind = "bundled"' in text
    finally:
        _tmux("kill-session", "-t", session)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_y_n_answer_waits_for_its_enter(tmp_path, _isolated_home):
    """`n` then Enter at "Choose another folder?": the `n` answered at once and the Enter
    answered the next question ("Measure …? Yes"), starting a measurement nobody asked for.
    Each key goes alone here; after the `n` its question still waits, and so does the next."""
    session = f"k3yn-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "run.sh"
    script.write_text(
        f"export K3TUI_HOME={_isolated_home} HOME={tmp_path} HF_HOME={tmp_path}/hf\n"
        f"unset HF_TOKEN\ncd {Path.cwd()}\n"
        f"{sys.executable} -m k3tui setup\necho EXIT=$?\nsleep 60\n")
    _tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", f"bash {script}")

    def key(name):
        _tmux("send-keys", "-t", session, name)

    try:
        _wait_for(session, "Which checkpoint?")
        key("Enter")
        _wait_for(session, "Where should the checkpoint go?")
        key("Enter")
        screen = _wait_for(session, "Choose another folder?", "Measure what the real model")
        if "Choose another folder?" in screen:  # a disk below 1.67 TB (every CI machine)
            key("n")
            screen = _wait_for(session, "(Y/n) No")      # shown, not yet taken
            assert "Measure what the real model" not in screen
            key("Enter")
        screen = _wait_for(session, "Measure what the real model")
        assert "Measuring" not in screen
        key("n")
        screen = _wait_for(session, "download)? (Y/n) No")
        assert "Hugging Face token" not in screen and "Measuring" not in screen
        key("Enter")
        screen = _wait_for(session, "Hugging Face token")
        assert "Measuring" not in screen
        key("C-c")
        screen = _wait_for(session, "EXIT=")
        assert "EXIT=130" in screen and not (_isolated_home / "config.toml").exists()
    finally:
        _tmux("kill-session", "-t", session)
