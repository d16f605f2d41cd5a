"""Fixtures for the download tests: a small repo folder served by the loopback fake hub."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hub_helpers import BIG, REPO_ID, SMALL

from fakehub import FakeHub


@pytest.fixture
def repo_dir(tmp_path) -> Path:
    d = tmp_path / "remote"
    (d / "sub").mkdir(parents=True)
    rnd = __import__("random").Random(7)
    (d / BIG).write_bytes(rnd.randbytes(6 * (1 << 20) + 12345))
    (d / SMALL).write_bytes(rnd.randbytes(3 * (1 << 20) + 7))
    (d / "sub" / "extra.bin").write_bytes(rnd.randbytes(1 << 20))
    (d / "config.json").write_text('{"model_type": "kimi_k3"}\n')
    return d


@pytest.fixture
def hub(repo_dir, monkeypatch):
    h = FakeHub(repo_dir, REPO_ID, cdn=True)
    monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("K3TUI_DL_BACKOFF_S", "0.05")
    # a loaded box never stalls 30 s; the stall tests set their own
    monkeypatch.setenv("K3TUI_DL_TIMEOUT_S", "30")
    yield h
    h.stop()


@pytest.fixture
def small_fs(tmp_path):
    """A 12 MiB tmpfs (needs root); skipped where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (ENOSPC is injected in test_dl_transfer)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
