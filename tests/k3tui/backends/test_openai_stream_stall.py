"""A backend that goes silent without hanging up: a real `python -m engine serve`, started
by k3tui's launcher, stopped with SIGSTOP mid-answer and read through the real client
(`RunningBackend.chat`, `stream_chat`); and servers that are silent for a reason (a
llama-server prefill, pings in between) that must not be taken for stalled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import httpx
import pytest
from raw_http_server import RawHTTPServer, sse_head

from k3tui.backends.events import BackendError, ContentDelta, Finished, ReasoningDelta
from k3tui.backends.openai_stream import STALL_PINGS, Silence, stream_chat

HI = [{"role": "user", "content": "Hello there"}]
WITHIN_S = 60.0  # a client that never notices fails the test here, not after 900 s


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from engine.checkpoint.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("stall_ckpt"), "small", seed=0)


@pytest.fixture
def engine(ckpt):
    """start(*engine args) -> a RunningBackend whose answers take 0.2 s a token, so one is
    still streaming when the test stops the process; continued and stopped afterwards."""
    from k3tui.backends.bundled import start_engine

    started = []

    def start(*args: str):
        backend = start_engine(ckpt, args=["--steer-demo", "--debug-token-delay", "0.2", *args])
        started.append(backend)
        return backend

    yield start
    for backend in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(backend.pid, signal.SIGCONT)
        backend.stop()


async def answer_until_stopped(stream, pid: int) -> list:
    """The events of `stream`; the engine gets SIGSTOP as soon as the first text arrives."""
    events: list = []

    async def read() -> None:
        async for event in stream:
            events.append(event)
            if isinstance(event, (ReasoningDelta, ContentDelta)) and len(texts(events)) == 1:
                os.kill(pid, signal.SIGSTOP)

    await asyncio.wait_for(read(), WITHIN_S)
    return events


def texts(events: list) -> list:
    return [e for e in events if isinstance(e, (ReasoningDelta, ContentDelta))]


async def resumes_and_answers(backend) -> None:
    """SIGCONT: the engine finds the stalled client gone and answers the next request."""
    os.kill(backend.pid, signal.SIGCONT)
    again = [e async for e in backend.chat(HI, max_tokens=4)]
    assert isinstance(again[-1], Finished), again[-1]


async def test_ls_stall_a_stopped_engine_process_is_named_with_the_way_back(engine):
    backend = engine()  # pings every 15 s: the process state tells first
    events = await answer_until_stopped(backend.chat(HI, max_tokens=200, check_s=0.1),
                                        backend.pid)
    last = events[-1]
    assert isinstance(last, BackendError), last
    assert last.message == (f"The backend stopped answering: its process (pid {backend.pid}) "
                            "is stopped, suspended by SIGSTOP or Ctrl+Z.")
    assert f"kill -CONT {backend.pid}" in last.next_step and "kept" in last.next_step
    assert texts(events)  # what came before the stop is the answer so far
    await resumes_and_answers(backend)


async def test_ls_stall_an_engine_silent_for_three_announced_pings(engine):
    """No process to look at (a remote server): the engine's announced keep-alive is the
    measure, 3 × 0.5 s here."""
    backend = engine("--debug-ping-seconds", "0.5")
    with httpx.stream("POST", backend.base_url + "/v1/chat/completions",
                      json={"messages": HI, "max_tokens": 1, "stream": True}) as resp:
        assert resp.headers["x-k3-ping-seconds"] == "0.5"
        resp.read()
    events = await answer_until_stopped(stream_chat(backend.base_url, HI, max_tokens=200),
                                        backend.pid)
    last = events[-1]
    assert isinstance(last, BackendError) and texts(events), last
    assert last.message == ("The backend stopped answering: nothing came for 1.5 s although "
                            "it sends a keep-alive every 0.5 s.")
    await resumes_and_answers(backend)


def chunk(**delta) -> bytes:
    finish = delta.pop("finish", None)
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


@pytest.mark.parametrize("pings", [True, False])
async def test_ls_stall_keep_alives_are_what_an_announcing_server_is_judged_by(pings):
    """Announced 0.5 s (a 1.5 s window), then 2.5 s without text: with a ping every 0.1 s
    the answer goes on, without them it is stalled."""

    def respond(head):
        yield sse_head(extra="X-K3-Ping-Seconds: 0.5\r\n") + chunk(content="Hel")
        for _ in range(25):
            time.sleep(0.1)
            if pings:
                yield b":\n\n"
        yield chunk(content="lo", finish="stop") + b"data: [DONE]\n\n"

    srv = RawHTTPServer(respond)
    try:
        events = await asyncio.wait_for(
            collect(stream_chat(srv.url, HI, stopped_pid=lambda: None, check_s=0.05)), WITHIN_S)
    finally:
        srv.stop()
    if pings:
        assert isinstance(events[-1], Finished) and "".join(
            e.text for e in texts(events)) == "Hello"
    else:
        assert isinstance(events[-1], BackendError) and "keep-alive" in events[-1].message
        assert [e.text for e in texts(events)] == ["Hel"]


async def test_ls_stall_a_server_that_announces_nothing_may_be_silent(monkeypatch):
    """llama-server says nothing through a long prefill and announces no keep-alive: with
    its process running, silence longer than any window is no stall."""

    def respond(head):
        time.sleep(1.0)  # before the head: a prefill behind a busy slot
        yield sse_head()
        time.sleep(1.5)  # then the prompt itself
        yield chunk(content="ok", finish="stop") + b"data: [DONE]\n\n"

    looked = []
    srv = RawHTTPServer(respond)
    try:
        events = await asyncio.wait_for(collect(stream_chat(
            srv.url, HI, stopped_pid=lambda: looked.append(1), check_s=0.05)), WITHIN_S)
    finally:
        srv.stop()
    assert isinstance(events[-1], Finished) and texts(events)[0].text == "ok"
    assert looked  # the process was looked at while it was silent, and found running


async def collect(stream) -> list:
    return [e async for e in stream]


@pytest.mark.parametrize("value, window", [("15", 15.0 * STALL_PINGS), ("0.5", 1.5),
                                           ("0", None), ("-1", None), ("nan", None),
                                           ("inf", None), ("1e308", None), ("soon", None),
                                           (None, None)])
def test_ls_stall_only_a_sane_announced_interval_is_believed(value, window):
    headers = {"X-K3-Ping-Seconds": value} if value is not None else {}
    silence = Silence()
    silence.announced(httpx.Response(200, headers=headers))
    assert silence.window_s == window
