"""Test isolation: no test touches the user's home or the network beyond loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("k3home")
    monkeypatch.setenv("K3TUI_HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    yield home


@pytest.fixture
def shared_dir() -> Path:
    """`../shared` beside the repo; a user's clone has none, so tests that need it skip."""
    if not SHARED.is_dir():
        pytest.skip("../shared is absent (fixtures ship only with the team's checkout)")
    return SHARED


@pytest.fixture
def tiny_a(shared_dir) -> Path:
    path = shared_dir / "fixtures" / "kimi-k3" / "tiny-a"
    if not path.is_dir():
        pytest.skip("tiny-a fixture is absent")
    return path


def env_without_k3(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: the current one plus overrides."""
    env = dict(os.environ)
    env.update(extra)
    return env
