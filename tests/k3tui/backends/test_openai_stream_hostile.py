"""The SSE client against a hostile or broken server: real sockets on loopback
(raw_http_server.RawHTTPServer writes whatever bytes a test gives, framing rules or not).
Every answer ends in typed events, the last one `Finished` or `BackendError`; nothing
raises, nothing is read without bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from raw_http_server import RawHTTPServer, sse_head

from k3tui.backends.events import BackendError, ContentDelta, Finished
from k3tui.backends.openai_stream import stream_chat

HANG = 30.0  # hang guard only: a healthy exchange takes milliseconds
END = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
       b"data: [DONE]\n\n")


def data(obj) -> bytes:
    """One SSE event, its JSON written as llama-server and the engine do: UTF-8, unescaped."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def delta(**d) -> dict:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}


@pytest.fixture
def serve():
    servers: list[RawHTTPServer] = []

    def make(*parts: bytes, respond=None) -> RawHTTPServer:
        srv = RawHTTPServer(respond or (lambda head: parts))
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.stop()


async def collect(url: str) -> list:
    async def run() -> list:
        return [e async for e in stream_chat(url, [{"role": "user", "content": "hi"}],
                                             api_key="k3-secret-key")]

    return await asyncio.wait_for(run(), HANG)


def content(events) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


@pytest.mark.parametrize("text", ["a\u2028b", "a\u2029b", "x = 1\u2028y = 2"])
async def test_lsh_unicode_line_separators_inside_a_chunk_do_not_cut_it(serve, text):
    # JSON writes U+2028/U+2029 unescaped; only CR and LF end an SSE line
    srv = serve(sse_head(), data(delta(content=text)), END)
    events = await collect(srv.url)
    assert content(events) == text, events
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"


async def test_lsh_next_line_and_cr_line_ends_follow_the_sse_spec(serve):
    # U+0085 (NEL) in a string is no line end (and is a control character: cleaned away);
    # CR alone and CRLF are line ends, also split across two writes
    first = b"data: " + json.dumps(delta(content="a\u0085b"), ensure_ascii=False).encode()
    srv = serve(sse_head(), first + b"\r", b"\r", b"data: " + json.dumps(delta(content="c"))
                .encode() + b"\r\n\r\n", END)
    events = await collect(srv.url)
    assert content(events) == "abc", events
    assert isinstance(events[-1], Finished)


async def test_lsh_a_stream_is_utf8_whatever_its_charset_says(serve):
    srv = serve(sse_head(content_type="text/event-stream; charset=utf-32"),
                data(delta(content="héllo")),
                b'data: {"choices":[{"index":0,"delta":{"content":"\xff!"}}]}\n\n', END)
    events = await collect(srv.url)
    assert content(events) == "héllo\ufffd!", events
    assert isinstance(events[-1], Finished)


# ---- sizes: nothing from the server is read without bound ---------------------------------

BIG = 64 * 2**20  # what the server offers; the client must hang up long before its end


def endless(piece: bytes, total: int = BIG):
    for _ in range(total // len(piece)):
        yield piece


@pytest.mark.parametrize("body", [
    lambda: endless(b"a" * 2**16),                          # one line that never ends
    lambda: endless(b"data: " + b"x" * 2**16 + b"\n"),      # one event that never ends
    lambda: endless(b'data: {"choices": "' + b"x" * 2**16),  # a chunk that never ends
], ids=["line", "event", "chunk"])
async def test_lsh_an_event_without_end_is_refused_after_1_mib(serve, body):
    srv = serve(respond=lambda head: [sse_head(), data(delta(content="ok")), *body()])
    events = await collect(srv.url)
    assert content(events) == "ok"
    assert isinstance(events[-1], BackendError) and "larger than 1 MiB" in events[-1].message
    assert srv.done.wait(HANG) and srv.cut.is_set(), f"the client read all {srv.sent} bytes"


async def test_lsh_a_huge_error_body_is_not_read_to_its_end(serve):
    head = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
            b"Connection: close\r\n\r\n")
    srv = serve(respond=lambda h: [head, b"disk on fire ", *endless(b"m" * 2**16)])
    events = await collect(srv.url)
    assert len(events) == 1 and isinstance(events[0], BackendError)
    assert "HTTP 500: disk on fire" in events[0].message and len(events[0].message) < 400
    assert srv.done.wait(HANG) and srv.cut.is_set(), f"the client read all {srv.sent} bytes"


async def test_lsh_a_long_error_message_is_cut_to_a_sentence(serve):
    srv = serve(sse_head(), data({"error": {"code": 500, "message": "bad " * 100_000}}))
    events = await collect(srv.url)
    err = events[-1]
    assert isinstance(err, BackendError) and err.message.startswith("The backend reported")
    assert len(err.message) < 600 and err.message.endswith("….")
