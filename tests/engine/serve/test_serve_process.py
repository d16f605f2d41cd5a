"""A real `python -m engine serve` process on 127.0.0.1 with a synthesised checkpoint,
driven with httpx and with the official `openai` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.checkpoint.synth import synthesize

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("srv_small"), "small", seed=0)


class ServeProcess:
    def __init__(self, *args: str, wait_ready: bool = True, timeout: float = 60.0):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("listening on http://"):
            self.stop()
            raise AssertionError(f"no listening line: {line!r} {self.proc.stderr.read()}")
        self.url = line.split()[-1]
        if wait_ready:
            deadline = time.monotonic() + timeout
            while httpx.get(self.url + "/health", timeout=30).status_code != 200:
                assert time.monotonic() < deadline, "server never became ready"
                assert self.proc.poll() is None, self.proc.stderr.read()
                time.sleep(0.05)

    def metric(self, name: str, **kw) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30, **kw).text.splitlines():
            if line.startswith(f"k3_{name} "):
                return float(line.split()[1])
        raise AssertionError(name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def demo_server(small_ckpt):
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--steer-demo")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)


KEY = "k3-test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed_server(small_ckpt):
    """No steering (the random model's own sampling), an API key."""
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--api-key", KEY, "--model-name", "k3-small")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)


def sse_chunks(resp) -> tuple[list[dict], list[str]]:
    lines = [line for line in resp.iter_lines() if line]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")], lines


def test_srv_proc_stream_with_httpx(demo_server):
    body = {"messages": HI, "stream": True, "max_tokens": 400, "seed": 2,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", demo_server.url + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks, lines = sse_chunks(r)
    assert lines[-1] == "data: [DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert reasoning.strip() and content.strip() and "<|" not in reasoning + content
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    usage, timings = chunks[-1]["usage"], chunks[-1]["timings"]
    assert usage["completion_tokens"] == timings["predicted_n"] > 10
    assert timings["prompt_n"] == usage["prompt_tokens"] and timings["prompt_ms"] > 0
    k3 = chunks[1]["k3"]
    assert k3["s_per_token"] > 0 and k3["rss_gb"] > 0.01 and "gb_read" in k3
    assert chunks[-1]["model"] == "demo model — random weights, not Kimi-K3"


def test_srv_proc_openai_client(demo_server):
    client = openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["demo model — random weights, not Kimi-K3"]
    stream = client.chat.completions.create(
        model="anything",
        messages=HI,
        stream=True,
        max_tokens=400,
        seed=4,
        stream_options={"include_usage": True},
    )
    reasoning, content, finish, usage = "", "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert reasoning and content and finish == "stop" and usage.completion_tokens > 10
    full = client.chat.completions.create(model="x", messages=HI, max_tokens=400, seed=4)
    assert full.choices[0].message.content == content
    assert full.choices[0].message.model_extra["reasoning_content"] == reasoning
    assert full.usage.prompt_tokens == usage.prompt_tokens


def test_srv_proc_cancel_mid_stream(keyed_server):
    srv = keyed_server
    before = srv.metric("requests_cancelled_total", headers=AUTH)
    body = {"messages": HI, "stream": True, "max_tokens": 4000, "ignore_eos": True, "seed": 1}
    with httpx.stream("POST", srv.url + CHAT, json=body, headers=AUTH, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: {")
            if n == 5:
                break
    # the connection is closed: generation must stop within about one token
    deadline = time.monotonic() + 30
    while srv.metric("requests_processing", headers=AUTH) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.metric("requests_processing", headers=AUTH) == 0
    assert srv.metric("requests_cancelled_total", headers=AUTH) == before + 1
    frozen = srv.metric("tokens_predicted_total", headers=AUTH)
    time.sleep(0.5)
    assert srv.metric("tokens_predicted_total", headers=AUTH) == frozen < 400


def test_srv_proc_concurrent_request_waits(keyed_server):
    import threading

    srv, results = keyed_server, {}
    body = {"messages": HI, "max_tokens": 60, "ignore_eos": True, "seed": 3}

    def run_b():
        r = httpx.post(srv.url + CHAT, json=body, headers=AUTH, timeout=120)
        results["b"] = (r, time.monotonic())

    # `a` is a long streamed reply that holds the slot until the test has seen `b` wait
    # (a 60-token `a` lasted ~0.6 s: on a loaded box it could end before `b` arrived)
    long = {**body, "max_tokens": 4000, "stream": True}
    b = threading.Thread(target=run_b)
    with httpx.stream("POST", srv.url + CHAT, json=long, headers=AUTH, timeout=60) as ra:
        assert ra.status_code == 200
        lines = ra.iter_lines()  # kept: a closed line iterator would close the connection
        for line in lines:
            if '"content":"' in line or '"reasoning_content":"' in line:
                break  # a generates
        assert srv.metric("requests_processing", headers=AUTH) == 1  # a holds the slot
        b.start()
        deadline = time.monotonic() + 30
        while srv.metric("requests_deferred", headers=AUTH) != 1:  # b waits for it
            assert time.monotonic() < deadline and b.is_alive()
            time.sleep(0.02)
        assert b.is_alive() and srv.metric("requests_processing", headers=AUTH) == 1
        a_left = time.monotonic()
    b.join(120)  # a's client left: its generation stops and b gets the slot
    rb, b_done = results["b"]
    assert rb.status_code == 200 and b_done > a_left
    assert rb.json()["usage"]["completion_tokens"] == 60
    # same seed, same prompt, alone: identical output (waiting its turn changed nothing)
    rc = httpx.post(srv.url + CHAT, json=body, headers=AUTH, timeout=120)
    assert rc.json()["choices"][0]["message"] == rb.json()["choices"][0]["message"]
    assert srv.metric("requests_deferred", headers=AUTH) == 0


def test_srv_proc_api_key(keyed_server):
    srv = keyed_server
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.post(srv.url + CHAT, json={"messages": HI})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(srv.url + "/v1/models", headers={"X-Api-Key": KEY}).json()["data"][0]["id"]
        == "k3-small"
    )
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="k3-small", messages=HI, max_tokens=2)
    good = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    out = good.chat.completions.create(model="k3-small", messages=HI, max_tokens=3, seed=1)
    assert out.usage.completion_tokens <= 3 and out.model == "k3-small"


def test_srv_proc_error_shapes(keyed_server):
    srv = keyed_server
    r = httpx.post(srv.url + CHAT, content=b"{oops", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        srv.url + CHAT, json={"messages": HI, "reasoning_effort": "medium"}, headers=AUTH
    )
    assert r.status_code == 400 and "low, high or max" in r.json()["error"]["message"]
    r = httpx.get(srv.url + "/v2/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "word " * 9000}]
        )


def test_srv_proc_props_and_metrics(keyed_server):
    props = httpx.get(keyed_server.url + "/props", headers=AUTH).json()
    assert props["memory_plan"]["mode"] == "resident" and props["demo"] is False
    assert props["default_generation_settings"]["n_ctx"] == 8192
    text = httpx.get(keyed_server.url + "/metrics", headers=AUTH).text
    assert "# TYPE k3_tokens_predicted_total counter" in text and "k3_model_loaded 1" in text


def test_srv_proc_loading_503_then_200(small_ckpt):
    # The delay starts before the server prints its address; 1.5 s left a loaded box too
    # little time to read that line and ask twice while the model was still "loading".
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--debug-load-delay", "5", wait_ready=False)
    try:
        r = httpx.get(srv.url + "/health", timeout=30)
        assert r.status_code == 503
        body = r.json()
        assert body["error"]["message"] == "Loading model" and body["progress"]["elapsed_s"] >= 0
        assert httpx.post(srv.url + CHAT, json={"messages": HI}, timeout=30).status_code == 503
        deadline = time.monotonic() + 60
        while (r := httpx.get(srv.url + "/health", timeout=30)).status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert (
            httpx.post(
                srv.url + CHAT, json={"messages": HI, "max_tokens": 2}, timeout=30
            ).status_code
            == 200
        )
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", "serve", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_srv_proc_refuses_non_loopback_without_key(small_ckpt):
    out = run_serve(str(small_ckpt), "--host", "0.0.0.0", "--port", "0")
    assert out.returncode == 2 and out.stdout == ""
    assert "refusing to bind 0.0.0.0 without --api-key" in out.stderr
    assert "Traceback" not in out.stderr


def test_srv_proc_non_loopback_with_key_binds(small_ckpt, monkeypatch):
    monkeypatch.setenv("K3_API_KEY", KEY)  # the key from the environment, not argv
    srv = ServeProcess(str(small_ckpt), "--host", "0.0.0.0", "--port", "0", wait_ready=False)
    try:
        assert srv.url.startswith("http://0.0.0.0:")
        port = srv.url.rsplit(":", 1)[1]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=AUTH)
        assert r.status_code in (200, 503)
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)


def test_srv_proc_load_failures_are_one_sentence(small_ckpt, tmp_path):
    out = run_serve(str(tmp_path), "--port", "0")
    assert (
        out.returncode == 1 and "has no config.json" in out.stderr and "Traceback" not in out.stderr
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in small_ckpt.iterdir():
        if f.name != "model-00002-of-000007.safetensors":
            (broken / f.name).symlink_to(f)
    out = run_serve(str(broken), "--port", "0")
    assert out.returncode == 1, out.stderr
    assert out.stdout.startswith("listening on http://127.0.0.1:")
    assert "the model failed to load" in out.stderr.splitlines()[-1]


def test_srv_proc_sigterm_ends_a_running_stream(small_ckpt):
    srv = ServeProcess(str(small_ckpt), "--port", "0")
    body = {"messages": HI, "stream": True, "max_tokens": 6000, "ignore_eos": True}
    with httpx.stream("POST", srv.url + CHAT, json=body, timeout=60) as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                srv.proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
        # the stream ends without [DONE] (cut, not finished) well before 6000 tokens
        assert "data: [DONE]" not in lines
        assert time.monotonic() - t0 < 20  # vs minutes for 6000 tokens; ~0.1 s measured
    assert srv.proc.wait(timeout=10) in (0, -signal.SIGTERM)
