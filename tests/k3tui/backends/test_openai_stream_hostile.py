"""The SSE client against a hostile or broken server: real sockets on loopback
(raw_http_server.RawHTTPServer writes whatever bytes a test gives, framing rules or not).
Every answer ends in typed events, the last one `Finished` or `BackendError`; nothing
raises, nothing is read without bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from raw_http_server import RawHTTPServer, sse_head

from k3tui.backends.events import BackendError, ContentDelta, Finished, TokenStats
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
    assert srv.cut.wait(HANG), f"the client read all {srv.sent} bytes"


async def test_lsh_a_huge_error_body_is_not_read_to_its_end(serve):
    head = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
            b"Connection: close\r\n\r\n")
    srv = serve(respond=lambda h: [head, b"disk on fire ", *endless(b"m" * 2**16)])
    events = await collect(srv.url)
    assert len(events) == 1 and isinstance(events[0], BackendError)
    assert "HTTP 500: disk on fire" in events[0].message and len(events[0].message) < 400
    assert srv.cut.wait(HANG), f"the client read all {srv.sent} bytes"


async def test_lsh_a_long_error_message_is_cut_to_a_sentence(serve):
    srv = serve(sse_head(), data({"error": {"code": 500, "message": "bad " * 100_000}}))
    events = await collect(srv.url)
    err = events[-1]
    assert isinstance(err, BackendError) and err.message.startswith("The backend reported")
    assert len(err.message) < 600 and err.message.endswith("….")


# ---- shapes: every field is checked before an event carries it ----------------------------

OSC52 = "\x1b]52;c;SElKQUNLRUQ=\x07"
WRONG_CHUNKS = [
    b'data: ' + b"[" * 100_000 + b"\n\n",                          # deeper than json can read
    b'data: {"usage": {"prompt_tokens": ' + b"9" * 5000 + b"}}\n\n",  # past int's digit limit
    data({"choices": "abc"}),
    data({"choices": [1, None, "x"]}),
    data({"choices": [{"index": 0, "delta": ["content", "x"]}]}),
    data({"choices": [{"index": "0", "delta": {"content": "never"}}]}),
    b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}], '
    b'"timings": {"predicted_n": NaN, "predicted_ms": Infinity, "prompt_n": -1e400}}\n\n',
    data({**delta(content="b"), "timings": {"predicted_n": "7", "predicted_ms": [1],
                                          "prompt_ms": "fast", "prompt_n": {"a": 1}}}),
    data({"choices": [], "usage": {"prompt_tokens": {"n": 1}, "x_details": [1]}}),
    data({**delta(content="c"), "timings": {"predicted_n": 10**12, "predicted_ms": 1e300}}),
    data({**delta(content="d"), "k3": {"s_per_token": "slow", "gb_read": [1], "budget_gb":
                                      OSC52, "rss_gb": 10**400 // 10**300, "note": OSC52 + "n"}}),
    data({"choices": [], "usage": {"prompt_tokens": "12", "completion_tokens": True,
                                   "prompt_tokens_details": {"cached_tokens": "all"}}}),
    data({"choices": [{"index": 0, "delta": {}, "finish_reason": f"stop{OSC52}"}]}),
    b"data: [DONE]\n\n",
]


async def test_lsh_chunks_of_the_wrong_shape_never_raise_or_pass_through(serve):
    from k3tui.tui.stats import LatencyStats  # the consumer does arithmetic on the figures

    srv = serve(sse_head(), data(delta(content="ok ")), *WRONG_CHUNKS)
    gen = stream_chat(srv.url, [{"role": "user", "content": "hi"}])
    events = []
    while True:  # one chunk that raised would end the loop here with its exception
        try:
            events.append(await asyncio.wait_for(gen.__anext__(), HANG))
        except StopAsyncIteration:
            break
        if isinstance(events[-1], BackendError):
            assert "not JSON" in events[-1].message  # the first two chunks; then it stops
            break
    await gen.aclose()
    assert [type(e).__name__ for e in events] == ["ContentDelta", "TokenStats", "BackendError"]

    # the same chunks, one answer each, past the two that are not JSON
    for chunk in WRONG_CHUNKS[2:-1]:
        srv = serve(sse_head(), chunk, END)
        stats = LatencyStats()
        stats.start(0.0)
        for ev in await collect(srv.url):
            assert not isinstance(ev, BackendError), (chunk, ev)
            if isinstance(ev, TokenStats):
                assert ev.tokens == 1 and ev.backend_ms is None, (chunk, ev)
                assert ev.prompt_ms is None and ev.prompt_tokens is None, (chunk, ev)
                assert set(ev.k3) <= {"rss_gb", "note"} and ev.k3.get("rss_gb") in (None, 100)
                assert OSC52 not in ev.k3.get("note", "") and ev.k3.get("note") in (None, "n")
                stats.on_token(ev)
            if isinstance(ev, Finished):
                assert ev.usage == {"prompt_tokens_details": {}} or ev.usage == {}, ev
                assert ev.finish_reason in ("stop", None)
                stats.on_finished(ev)
        stats.snapshot()


async def test_lsh_figures_of_the_right_shape_still_count(serve):
    srv = serve(sse_head(),
                data({**delta(content="a"), "timings": {"predicted_n": 1, "predicted_ms": 4.0,
                                                       "prompt_n": 7, "prompt_ms": 21.5},
                      "k3": {"s_per_token": 0.25, "budget_gb": 8, "wait_trunk_s": None}}),
                data({**delta(content="bc"), "timings": {"predicted_n": 3, "predicted_ms": 10.0}}),
                data({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                "prompt_tokens_details": {"cached_tokens": 2}}}),
                b"data: [DONE]\n\n")
    events = await collect(srv.url)
    stats = [e for e in events if isinstance(e, TokenStats)]
    assert [(s.tokens, s.backend_ms) for s in stats] == [(1, 4.0), (2, 3.0)]
    assert stats[0].prompt_tokens == 7 and stats[0].prompt_ms == 21.5
    assert stats[0].k3 == {"s_per_token": 0.25, "budget_gb": 8, "wait_trunk_s": None}
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "length"
    assert fin.usage == {"prompt_tokens": 7, "completion_tokens": 3,
                         "prompt_tokens_details": {"cached_tokens": 2}}


# ---- /health and /v1/models: bounded too --------------------------------------------------

async def test_lsh_health_and_model_list_are_not_read_to_their_end(serve):
    from k3tui.backends.openai_stream import StreamTooLarge, health, list_models

    head = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\n\r\n")
    srv = serve(respond=lambda h: [head, b'{"error": {"message": "Loading\x1b]0;T\x07', *endless(
        b"m" * 2**16)])
    state = await asyncio.wait_for(health(srv.url), HANG)
    assert state.status == 503 and "\x1b" not in state.detail and len(state.detail) <= 200
    assert srv.cut.wait(HANG), f"the client read all {srv.sent} bytes"

    srv = serve(respond=lambda h: [sse_head(content_type="application/json"), b'{"data": [',
                                   *endless(b" " * 2**16)])
    with pytest.raises(StreamTooLarge):
        await asyncio.wait_for(list_models(srv.url), HANG)
    assert srv.cut.wait(HANG), f"the client read all {srv.sent} bytes"

    srv = serve(respond=lambda h: [sse_head(content_type="application/json"), b"[" * 100_000])
    with pytest.raises(ValueError):
        await asyncio.wait_for(list_models(srv.url), HANG)
