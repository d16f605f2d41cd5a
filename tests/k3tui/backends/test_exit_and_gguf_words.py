"""Issue 18: what k3tui says when a server dies or its GGUF is broken, from real processes
and real files: a SIGKILL is called an OOM kill only with the kernel's or the cgroup's word
for it; a truncated header and a split model without shard 1 are named as such."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

import pytest

from k3tui.backends.llama.gguf import check_shards
from k3tui.backends.running import RunningBackend
from k3tui.errors import K3Error


def _killed_backend(**kw) -> RunningBackend:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    os.kill(proc.pid, signal.SIGKILL)  # what a user's `kill -9` does
    proc.wait(60)
    return RunningBackend(kind="llama-server", base_url="http://127.0.0.1:1", api_key=None,
                          model="kimi-k3", pid=proc.pid, process=proc, **kw)


def test_a_manual_kill_9_is_not_blamed_on_the_oom_killer():
    message = _killed_backend().failure().message
    assert "was killed with SIGKILL" in message and "most likely" not in message
    assert ("not by the out-of-memory killer" in message
            or "the kernel log is not readable here" in message), message


def test_an_oom_kill_in_the_cgroup_events_is_called_one(tmp_path):
    # the cgroup k3tui made for the server counts it (the kernel's memory.events format)
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    backend = _killed_backend(cgroup_dir=tmp_path, memory_limit_bytes=96 * 2**30)
    assert backend.failure().message == ("The llama-server backend was killed by the "
                                         "out-of-memory killer (the memory limit was 96.0 "
                                         "GiB); k3tui does not restart it.")


def test_a_header_cut_short_names_the_cause(tmp_path):
    model = tmp_path / "tiny.gguf"
    # magic, version 3, 1 tensor, 1 key, then the key's length and half its name
    model.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", 20) + b"gen")
    with pytest.raises(K3Error) as info:
        check_shards(model)
    assert "()" not in info.value.message
    assert "tiny.gguf has an unreadable header (" in info.value.message


def test_a_folder_without_shard_1_says_so_not_no_models(tmp_path):
    for i in (2, 3):
        (tmp_path / f"Kimi-K3-IQ1_S-{i:05d}-of-00003.gguf").write_bytes(b"GGUF")
    with pytest.raises(K3Error) as info:
        check_shards(tmp_path)
    assert "holds 2 shards of a split GGUF but not its first shard, " \
           "Kimi-K3-IQ1_S-00001-of-00003.gguf" in info.value.message
    assert "k3tui download" in info.value.next_step
