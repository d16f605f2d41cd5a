"""The one confinement check: the probe and the llama-server launcher ask the same question
the same way, so `k3tui doctor` never promises a limit the launch then refuses (or the reverse)."""

from __future__ import annotations

import os
import subprocess

import pytest

from k3tui.backends.llama import server
from k3tui.probe.env import ProbeEnv
from k3tui.probe.isolation import check_systemd_scope

GIB = 2**30
PAGE = os.sysconf("SC_PAGE_SIZE")


def kernel_answer(out: str, rc: int = 0, err: str = ""):
    """A systemd-run stand-in: `{limit}` becomes MemoryMax rounded down to a page, as the
    kernel stores memory.max."""
    def run(argv, timeout=None):
        limit = int(next(a.split("=", 1)[1] for a in argv if a.startswith("MemoryMax=")))
        return subprocess.CompletedProcess(argv, rc, stdout=out.format(limit=limit - limit % PAGE),
                                           stderr=err)
    return run


ANSWERS = [kernel_answer("{limit}\n"), kernel_answer("max\n"),
           kernel_answer("", 1, "Failed to connect to bus: No medium found\n")]


@pytest.mark.parametrize("answer", ANSWERS)
def test_probe_and_launcher_reach_the_same_verdict_in_the_same_words(answer, tmp_path,
                                                                     monkeypatch):
    env = ProbeEnv()
    monkeypatch.setattr(env, "run", answer)
    probe_ok, probe_why = check_systemd_scope(env)
    limit = server.choose_memory_limit(int(21.2 * GIB), runner=answer, cgroup_dir=tmp_path / "no")
    assert (limit.method == "systemd-run") is probe_ok
    if not probe_ok:
        assert probe_why in limit.detail


def test_a_limit_the_kernel_rounds_to_whole_pages_still_applies(tmp_path):
    limit_bytes = int(21.2 * GIB)  # what a plan asks for is rarely page-aligned
    assert limit_bytes % PAGE
    limit = server.choose_memory_limit(limit_bytes, runner=kernel_answer("{limit}\n"),
                                   cgroup_dir=tmp_path / "no")
    assert limit.method == "systemd-run" and limit.limit_bytes == limit_bytes
    assert limit.prefix[:6] == ["systemd-run", "--user", "--scope", "--quiet", "-p",
                                f"MemoryMax={limit_bytes}"]
