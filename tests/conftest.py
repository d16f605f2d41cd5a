"""Test isolation: no test touches the user's home or the network beyond loopback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The reference fixtures are vendored, so a user's clone runs every exactness test.
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kimi-k3"
# Helper modules are imported by basename, and pytest's default import mode puts only a test
# file's own folder on sys.path: these folders' helpers are used from other folders too
# (tests/e2e, tests/k3tui). Test and helper basenames are unique across tests/. support/ holds
# the fakes (hub, scripted backend, screenshot scenes), outside the installed package.
for _folder in ("support", "k3tui/tui", "k3tui/backends", "k3tui/hub", "k3tui/probe"):
    sys.path.insert(0, str(REPO / "tests" / _folder))


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("k3home")
    monkeypatch.setenv("K3TUI_HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    yield home


@pytest.fixture(scope="session")
def tiny_a() -> Path:
    """The reference tiny checkpoint (`expected.json` holds its greedy ids and logits)."""
    return FIXTURES / "tiny-a"


@pytest.fixture(scope="session")
def ops_fixtures() -> Path:
    """Per-kernel reference inputs and outputs."""
    return FIXTURES / "ops"


def env_without_k3(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: the current one plus overrides."""
    env = dict(os.environ)
    env.update(extra)
    return env


# Tests that compare against the reference fixtures prove the README's exactness claim: such a
# test may fail, never skip (a skip would let a clone "pass" without checking anything).
_EXACTNESS_FIXTURES = {"tiny_a", "tiny_a_model", "ops", "ops_fixtures"}


def pytest_collection_modifyitems(items):
    for item in items:
        if _EXACTNESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("exactness")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and item.get_closest_marker("exactness"):
        report.outcome = "failed"
        report.longrepr = f"exactness test skipped ({report.longrepr}); it must run everywhere"
    return report
