"""After `k3tui download` and `k3tui pack` (the real CLI against a loopback hub serving the
reference tiny checkpoint): the config names the new files, or says how, and the next command
is printed. It took two `k3tui config set` before `k3tui chat` used a fresh download."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from k3tui.config import Config, config_exists, load_config, save_config
from fakehub import FakeHub

REPO_ID = "acme/tiny-k3"


@pytest.fixture
def hub(tiny_a, monkeypatch):
    h = FakeHub(tiny_a, REPO_ID)
    monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    yield h
    h.stop()


def k3(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ), stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def _next(out: str) -> list[str]:
    lines = out.splitlines()
    return [ln.strip() for ln in lines[lines.index("Next:") + 1:]]


def _elsewhere(tmp_path) -> Config:
    cfg = Config()
    cfg.model.dir = str(tmp_path / "Kimi-K3")
    cfg.model.trunk_dir = str(tmp_path / "Kimi-K3-trunk")
    save_config(cfg)
    return cfg


def test_a_download_with_no_config_records_its_folder_and_says_pack_next(hub, tmp_path):
    out = tmp_path / "tiny"
    p = k3("download", REPO_ID, "--dir", str(out), "--foreground")
    cfg = load_config()
    assert (cfg.model.dir, cfg.model.repo, cfg.model.kind, cfg.backend.kind) == \
        (str(out), REPO_ID, "safetensors", "bundled")
    assert "a new config" in p.stdout
    assert _next(p.stdout)[0].startswith("k3tui pack ") and "k3tui chat" in _next(p.stdout)[1]


def test_with_a_config_naming_another_folder_nobody_is_asked_and_the_commands_are_shown(
        hub, tmp_path):
    before = _elsewhere(tmp_path)
    out = tmp_path / "tiny"
    p = k3("download", REPO_ID, "--dir", str(out), "--foreground")   # no terminal: no question
    assert load_config() == before
    assert f"k3tui config set model.dir {out}" in p.stdout
    assert "k3tui config set model.trunk_dir ''" in p.stdout
    assert _next(p.stdout) == [f"k3tui pack {out}  pack the trunk for streaming (a "
                               "detached job too)"]
    p = k3("download", REPO_ID, "--dir", str(out))          # all here: the same advice
    assert "already here and verified" in p.stdout and "k3tui config set model.dir" in p.stdout


def test_a_pack_with_no_config_records_both_folders_and_says_chat_next(tiny_a, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_a, ckpt)
    p = k3("pack", str(ckpt), str(tmp_path / "trunk"), "--foreground")
    cfg = load_config()
    assert (cfg.model.dir, cfg.model.trunk_dir) == (str(ckpt), str(tmp_path / "trunk"))
    assert _next(p.stdout) == ["k3tui chat  talk to the model"]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_in_a_terminal_download_then_pack_offer_the_folders_and_chat_uses_them(hub, tmp_path):
    """The README path by hand: a config from setup names the default folder; the user
    downloads elsewhere, answers y, packs, and the config names both new folders."""
    from tui_helpers import Tmux

    _elsewhere(tmp_path)
    out = tmp_path / "tiny"
    env = {k: os.environ[k] for k in ("K3TUI_HOME", "HF_HOME", "HF_ENDPOINT",
                                      "HF_HUB_DISABLE_XET")}
    tmux = Tmux(f"k3next{os.getpid()}", env)
    try:
        tmux.start(f"{sys.executable} -m k3tui download {REPO_ID} --dir {out} --foreground; "
                   "echo EXIT=$?")
        tmux.wait_for(lambda s: "Use the new files from now on? [Y/n]" in s)
        tmux.keys("y")
        assert not config_exists() or load_config().model.dir != str(out)  # Enter takes it
        tmux.keys("Enter")
        screen = tmux.wait_for(lambda s: "EXIT=" in s)
        assert "EXIT=0" in screen and "k3tui pack  pack the trunk" in screen, screen
        assert load_config().model.dir == str(out) and load_config().model.trunk_dir == ""
        tmux.kill()
        tmux.start(f"{sys.executable} -m k3tui pack --foreground; echo EXIT=$?")
        screen = tmux.wait_for(lambda s: "EXIT=" in s)
        assert "EXIT=0" in screen and "k3tui chat  talk to the model" in screen, screen
        cfg = load_config()
        assert (cfg.model.dir, cfg.model.trunk_dir) == (str(out), str(out) + "-trunk")
    finally:
        tmux.close()
