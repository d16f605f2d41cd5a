"""The engine server under hostile requests: oversized bodies, non-finite and absurd
numbers, over-deep JSON, half-open connections. A real `python -m engine serve` on
127.0.0.1 (its log in a file, to show no traceback), plus the in-process server with a
tokenizer a test can hold, to show tokenising never blocks the event loop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.checkpoint.synth import synthesize

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hello there"}]
BIG = 50 * 2**20
HANG = 5.0  # hang guard for a single answer; a healthy server needs milliseconds


class Serve:
    """`python -m engine serve` with stdout/stderr in a file."""

    def __init__(self, ckpt: Path, log: Path, *args: str):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine", "serve", str(ckpt), "--port", "0", *args],
                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 60
        while "listening on http://" not in log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        self.url = log.read_text().split("listening on ")[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1])
        while httpx.get(self.url + "/health", timeout=30).status_code != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("srv_limits"), "small", seed=0)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    srv = Serve(ckpt, tmp_path_factory.mktemp("log") / "serve.log", "--steer-demo")
    yield srv
    srv.stop()


def assert_error(resp: httpx.Response, code: int, *words: str) -> None:
    err = resp.json()["error"]
    assert resp.status_code == code == err["code"], resp.text
    assert set(err) >= {"code", "message", "type"} and isinstance(err["message"], str)
    for word in words:
        assert word in err["message"], err["message"]


def read_until_closed(s: socket.socket) -> bytes:
    """What the server sent on `s` until it closed it (a reset counts as closed)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def raw_request(port: int, head: bytes, timeout: float = HANG) -> bytes:
    """Send `head` (no body), read until the server closes; what it answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        return read_until_closed(s)


def test_srv_limits_content_length_over_the_limit_is_413_before_the_body(server):
    # Only the head is sent: the answer must come from Content-Length alone.
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BIG}\r\n\r\n").encode()
    answer = raw_request(server.port, head)
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"connection: close" in rest.lower()
    err = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == 413 and "--max-body-mb" in err["message"]
    assert httpx.get(server.url + "/health", timeout=HANG).status_code == 200


def test_srv_limits_chunked_50mb_body_is_413_and_health_stays_fast(server):
    """A 50 MB chat body without Content-Length (chunked): refused once it passes the
    limit, while /health, polled all along, answers every time."""
    prefix = b'{"messages":[{"role":"user","content":"'
    piece = b"word " * 13000  # 64 KB

    def body():
        yield prefix
        for _ in range(BIG // len(piece)):
            yield piece
        yield b'"}]}'

    result: dict = {}

    def send() -> None:
        try:
            result["resp"] = httpx.post(server.url + CHAT, content=body(), timeout=120)
        except httpx.HTTPError as exc:
            result["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    polls = 0
    while sender.is_alive() or polls < 3:
        assert httpx.get(server.url + "/health", timeout=HANG).status_code == 200
        polls += 1
        sender.join(timeout=0.05)
    assert "error" not in result, result
    assert_error(result["resp"], 413, "4 MiB", "--max-body-mb")


NAN_CASES = [
    (b'{"messages": %s, "temperature": NaN}', "NaN"),
    (b'{"messages": %s, "temperature": Infinity}', "Infinity"),
    (b'{"messages": %s, "top_p": -Infinity}', "-Infinity"),
    (b'{"messages": %s, "temperature": 1e400}', "1e400"),
    (b'{"messages": %s, "seed": 1e400}', "1e400"),
]
DEEP = b'{"messages": %s, "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
WRONG = [
    ({"temperature": 10**400}, "temperature"),  # an integer float() cannot hold
    ({"top_p": 0}, "top_p"),                    # the sampler would keep no token at all
    ({"temperature": 1e-310}, "temperature"),   # logits / temperature overflow to NaN
    ({"top_k": 10**30}, "top_k"),
    ({"max_tokens": 1e300}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": [1]}, "max_tokens"),
    ({"seed": -7}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [5]}, "message 0"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, "content"),
]


def _post_raw(server, raw: bytes) -> httpx.Response:
    return httpx.post(server.url + CHAT, content=raw, timeout=30,
                      headers={"Content-Type": "application/json"})


def _no_traceback_since(server, offset: int) -> None:
    httpx.get(server.url + "/health", timeout=HANG)  # anything logged for the request is out
    assert "Traceback" not in server.log.read_text()[offset:]


@pytest.mark.parametrize("raw, word", NAN_CASES + [(DEEP, "64 levels")],
                         ids=["nan", "inf", "-inf", "1e400-temperature", "1e400-seed", "deep-100k"])
def test_srv_limits_non_finite_and_deep_json_is_400(server, raw, word):
    offset = len(server.log.read_text())
    resp = _post_raw(server, raw % json.dumps(HI).encode())
    assert_error(resp, 400, word)
    _no_traceback_since(server, offset)


def test_srv_limits_wrong_types_and_ranges_are_400_naming_the_field(server):
    offset = len(server.log.read_text())
    for fields, word in WRONG:
        resp = _post_raw(server, json.dumps({"messages": HI, "max_tokens": 4, **fields}).encode())
        assert_error(resp, 400, word)
    _no_traceback_since(server, offset)


LONE_SURROGATES = [
    (CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "name": "\\udc00"}]}'),
    (CHAT, b'{"messages": %s, "reasoning_effort": "\\ud800"}' % json.dumps(HI).encode()),
    ("/tokenize", b'{"content": "\\udfff"}'),
    ("/apply-template", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
]


@pytest.mark.parametrize("path, raw", LONE_SURROGATES,
                         ids=["content", "name", "echoed-in-error", "tokenize", "template"])
def test_srv_limits_lone_surrogate_is_400_not_a_crash(server, path, raw):
    """`"\\ud800"` is valid JSON but no character: the tokenizer and the UTF-8 writer of an
    error that echoes it would fail (a 500 with a traceback in the log)."""
    offset = len(server.log.read_text())
    resp = httpx.post(server.url + path, content=raw, timeout=30,
                      headers={"Content-Type": "application/json"})
    assert_error(resp, 400, "surrogate")
    _no_traceback_since(server, offset)


def test_srv_limits_surrogate_pair_is_one_character(server):
    resp = httpx.post(server.url + "/tokenize", content=b'{"content": "\\ud83d\\ude00"}',
                      timeout=30, headers={"Content-Type": "application/json"})
    assert resp.status_code == 200 and resp.json()["tokens"], resp.text
    detok = httpx.post(server.url + "/detokenize", json=resp.json(), timeout=30)
    assert detok.json()["content"] == "\U0001f600"


def test_srv_limits_64_levels_pass_65_do_not(server):
    raw = b'{"messages": %s, "max_tokens": 2, "metadata": ' % json.dumps(HI).encode()
    resp = _post_raw(server, raw + b"[" * 63 + b"]" * 63 + b"}")  # the object + 63 arrays
    assert resp.status_code == 200, resp.text
    assert_error(_post_raw(server, raw + b"[" * 64 + b"]" * 64 + b"}"), 400, "64 levels")


def test_srv_limits_half_open_connections_are_closed(ckpt, tmp_path):
    """50 sockets that send nothing, half a request line, a head without its body, or a
    second request cut short: the server closes each within its --read-timeout (2 s
    here; the deadline below is only a hang guard), and keeps serving meanwhile."""
    srv = Serve(ckpt, tmp_path / "serve.log", "--steer-demo", "--read-timeout", "2")
    try:
        stalled_body = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode()
        second_cut = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea"
        sends = [b""] * 20 + [b"GET /hea"] * 20 + [stalled_body] * 5 + [second_cut] * 5
        socks = []
        for data in sends:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            s.sendall(data)
            socks.append(s)
        assert httpx.get(srv.url + "/health", timeout=HANG).status_code == 200
        answers = []
        for s in socks:  # each recv below returns when the server closes (or after 30 s)
            try:
                out = read_until_closed(s)
            except TimeoutError:
                sent = sends[len(answers)][:40]
                pytest.fail(f"a connection that sent {sent!r} is still open after 30 s")
            answers.append(out)
            s.close()
        assert answers[:40] == [b""] * 40
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers[40:45]), answers[40]
        assert all(
            a.startswith(b"HTTP/1.1 200") and a.count(b"HTTP/1.1") == 1 for a in answers[45:]
        )
        assert httpx.get(srv.url + "/health", timeout=HANG).status_code == 200
        assert "Traceback" not in srv.log.read_text()
    finally:
        srv.stop()


def test_srv_limits_a_dripped_body_is_408_before_it_ends(ckpt, tmp_path):
    """A body sent a byte every 0.3 s never stalls for --read-timeout (2 s here), yet
    must not hold its connection for ever: the server answers 408 once the body falls
    behind 16 KiB/s past those 2 s — long before the 100 announced bytes could arrive
    (30 s at this pace; without the rule, no answer comes before them)."""
    srv = Serve(ckpt, tmp_path / "serve.log", "--steer-demo", "--read-timeout", "2")
    sent, stop = [0], threading.Event()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
            s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode())

            def drip() -> None:
                while sent[0] < 100 and not stop.wait(0.3):
                    try:
                        s.sendall(b" ")
                    except OSError:
                        return
                    sent[0] += 1

            dripper = threading.Thread(target=drip, daemon=True)
            dripper.start()
            out = read_until_closed(s)
            got_at = sent[0]
            stop.set()
            dripper.join(5)
        assert out.startswith(b"HTTP/1.1 408"), out[:200]
        assert b"too slowly" in out, out
        assert got_at < 100, "the answer came only once the whole body had arrived"
        assert httpx.get(srv.url + "/health", timeout=HANG).status_code == 200
        assert "Traceback" not in srv.log.read_text()
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------
# tokenising off the event loop (in-process server, a tokenizer the test holds)


class HeldTokenizer:
    """The test tokenizer, except that a text containing HOLD waits in encode_batch until
    the test releases it: a tokenisation that takes as long as the test wants."""

    def __init__(self, tok):
        self._tok = tok
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode_batch(self, texts):
        if any("HOLD" in t for t in texts):
            self.entered.set()
            assert self.release.wait(60), "the test never released the tokenizer"
        return self._tok.encode_batch(texts)


def test_srv_limits_health_answers_while_a_prompt_tokenises_and_a_generation_runs(inproc, test_tok):
    held, gate = HeldTokenizer(test_tok), threading.Event()
    srv = inproc(tok=held, gate=gate)
    results: dict = {}

    def post(name: str, content: str) -> None:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "seed": 1}
        results[name] = httpx.post(srv.url + CHAT, json=body, timeout=60)

    generating = threading.Thread(target=post, args=("gen", "hi"))
    generating.start()
    deadline = time.monotonic() + 30
    service = srv.service
    while service.scheduler.running is None or service.metrics.values["tokens_predicted_total"] < 1:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.01)
    tokenising = threading.Thread(target=post, args=("big", "HOLD " * 1000))
    tokenising.start()
    assert held.entered.wait(30), "the second request never reached the tokenizer"
    try:
        for _ in range(3):  # generation held by the gate, tokenizer held by the test
            assert httpx.get(srv.url + "/health", timeout=HANG).json() == {"status": "ok"}
    finally:
        held.release.set()
        gate.set()
    generating.join(60)
    tokenising.join(60)
    assert results["gen"].status_code == 200 and results["big"].status_code == 200
