"""`k3tui worker` with the REAL ggml-rpc-server of the pinned wheel: a detached job that
`k3tui jobs` lists and `k3tui worker stop` ends, answering the head's handshake, never on a
public or wildcard address."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from llama_helpers import k3tui_cli, real_binary, start_worker, worker_process

from k3tui.backends.llama import rpc


@pytest.fixture
def env(_isolated_home):
    env = dict(os.environ)
    yield env
    k3tui_cli("worker", "stop", env=env)


@pytest.mark.parametrize("host", ["0.0.0.0", "8.8.8.8"])
def test_worker_refuses_a_public_or_wildcard_bind_in_one_sentence(env, host):
    done = k3tui_cli("worker", "--host", host, env=env)
    assert done.returncode == 2
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"k3tui: A worker must not listen on {host}")
    assert "no authentication" in first and first.count(". ") == 0  # one sentence
    assert "No jobs" in k3tui_cli("jobs", env=env).stdout  # nothing was started


@pytest.mark.slow
def test_worker_runs_as_a_job_answers_the_handshake_and_stops(env):
    real_binary()
    said: list[str] = []
    endpoint = start_worker(env, said=said)
    assert f"k3tui config set llama_server.rpc '[\"{endpoint}\"]'" in said[0]
    server = worker_process(env, endpoint)
    status = rpc.probe(endpoint)
    # the same build as the head: the protocol the head's own ggml-rpc-server prints
    assert status.ok and status.version == rpc.server_protocol(rpc.find_rpc_server())
    assert status.total_bytes > 0
    listing = k3tui_cli("jobs", env=env).stdout
    assert endpoint in listing and "running" in listing and "RPC worker" in listing
    # its tensor cache in the models folder; every usable core, not the binary's one
    cmd = server.cmdline()
    assert cmd[cmd.index("-H") + 1:cmd.index("-H") + 4] == ["127.0.0.1", "-p",
                                                            endpoint.split(":")[1]]
    assert "-c" in cmd and cmd[cmd.index("-t") + 1] == str(len(os.sched_getaffinity(0)))
    models = Path(env["K3TUI_HOME"]) / "models"
    assert server.environ()["LLAMA_CACHE"] == str(models / "rpc-cache")
    # a head that dies mid-send must not kill it: SIGPIPE stays ignored in the worker
    ignored = int(next(line for line in Path(f"/proc/{server.pid}/status").read_text()
                       .splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (signal.SIGPIPE - 1))
    # the memory limit is applied and read back, or the job says plainly it is not
    state = next(j for j in json.loads(k3tui_cli("jobs", "--json", env=env).stdout)
                 if j["target"] == endpoint)
    assert "read back: applies" in state["message"] or "could not confine the worker" \
        in state["message"]
    stopped = k3tui_cli("worker", "stop", endpoint, env=env)
    assert stopped.returncode == 0 and "cancelled" in stopped.stdout
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    assert rpc.probe(endpoint).state == "refused"


@pytest.mark.slow
def test_worker_dies_with_its_job_process(env):
    """A job killed with SIGKILL (nothing can catch it) takes its ggml-rpc-server along:
    no worker keeps listening that no job watches."""
    real_binary()
    endpoint = start_worker(env)
    server = worker_process(env, endpoint)
    psutil.Process(server.ppid()).kill()
    deadline = time.monotonic() + 30
    while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker outlived its job"
        time.sleep(0.05)
    assert "failed" in k3tui_cli("jobs", env=env).stdout


@pytest.mark.slow
def test_worker_port_taken_is_refused_before_a_job_starts(env):
    real_binary()
    endpoint = start_worker(env)
    host, port = endpoint.split(":")
    done = k3tui_cli("worker", "--port", port, env=env)
    assert done.returncode == 2 and f"Port {port} on {host} cannot be listened on" \
        in done.stderr
    jobs = json.loads(k3tui_cli("jobs", "--json", env=env).stdout)
    assert len(jobs) == 1
