"""The SSE client against captured llama-server streams and hand-made edge cases,
served over real HTTP on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llama_helpers import ReplayServer

from k3tui.backends.events import (
    BackendError,
    ContentDelta,
    Finished,
    ReasoningDelta,
    TokenStats,
    Waiting,
)
from k3tui.backends.openai_stream import (
    ChunkInterpreter,
    api_base,
    build_request,
    health,
    iter_sse_data,
    stream_chat,
)

HERE = Path(__file__).parent


@pytest.fixture
def replay():
    server = ReplayServer()
    yield server
    server.stop()


def sse(*chunks) -> list[bytes]:
    out = []
    for c in chunks:
        out.append(c if isinstance(c, bytes) else f"data: {json.dumps(c)}\n\n".encode())
    return out


def delta(**d):
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}],
            "object": "chat.completion.chunk"}


async def collect(url, **kw):
    return [e async for e in stream_chat(url, [{"role": "user", "content": "hi"}], **kw)]


def texts(events, cls):
    return "".join(e.text for e in events if isinstance(e, cls))


async def test_ls_captured_budget_stream_separates_reasoning_and_content(replay):
    raw = (HERE / "capture_budget.sse").read_bytes()
    replay.parts = [raw[i:i + 37] for i in range(0, len(raw), 37)]  # split mid-line
    events = await collect(replay.url, max_tokens=8)
    expected = [json.loads(p) for p in iter_sse_data(raw.decode().split("\n")) if p != "[DONE]"]
    want_r = "".join(c["choices"][0]["delta"].get("reasoning_content") or ""
                     for c in expected if c["choices"])
    want_c = "".join(c["choices"][0]["delta"].get("content") or ""
                     for c in expected if c["choices"])
    assert want_r and want_c
    assert texts(events, ReasoningDelta) == want_r
    assert texts(events, ContentDelta) == want_c
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "length"
    assert fin.usage["completion_tokens"] == 8
    assert fin.timings["predicted_n"] == 8
    stats = [e for e in events if isinstance(e, TokenStats)]
    assert sum(s.tokens for s in stats) <= 8 and all(s.backend_ms is not None for s in stats)
    assert stats[0].prompt_tokens == expected[1]["timings"]["prompt_n"]
    # the request asked for usage and per-token timings
    req = replay.requests[0]
    assert req["stream"] and req["timings_per_token"] and req["stream_options"]["include_usage"]
    assert req["max_tokens"] == 8


async def test_ls_length_with_empty_content_explains_budget(replay):
    replay.parts = [(HERE / "capture_length_empty.sse").read_bytes()]
    events = await collect(replay.url, max_tokens=5)
    assert texts(events, ContentDelta) == "" and texts(events, ReasoningDelta)
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "length"
    assert "reasoning" in fin.note and "max_tokens" in fin.note and "reasoning_budget" in fin.note


async def test_ls_pings_repeated_roles_multi_key_and_k3(replay):
    k3 = {"s_per_token": 0.25, "gb_read": 1.5, "mb_per_s": 800.0, "true_hit_rate": 0.3,
          "rss_gb": 3.0, "budget_gb": 8.0, "compute_s": 0.1, "wait_trunk_s": None,
          "wait_experts_s": 0.05}
    replay.parts = sse(b": ping\n\n", delta(role="assistant", content=None),
                       b":\n\n", delta(role="assistant", content=None),
                       {**delta(reasoning_content="think ", content="say"), "k3": k3},
                       b"event: message\ndata: " + json.dumps(delta(content=" more")).encode()
                       + b"\r\n\r\n",
                       {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                       b"data: [DONE]\n\n")
    events = await collect(replay.url)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["ReasoningDelta", "ContentDelta", "TokenStats", "ContentDelta",
                     "TokenStats", "Finished"]
    assert events[2].k3 == k3 and events[2].backend_ms == pytest.approx(250.0)
    assert texts(events, ContentDelta) == "say more"
    assert events[-1].finish_reason == "stop" and events[-1].note == ""


async def test_ls_error_chunk_mid_stream_stops_with_message(replay):
    replay.parts = sse(delta(content="partial"),
                       {"error": {"code": 500, "message": "The model produced output that does "
                                  "not match the expected format", "type": "server_error"}},
                       delta(content="never"))
    events = await collect(replay.url)
    assert texts(events, ContentDelta) == "partial"
    err = events[-1]
    assert isinstance(err, BackendError) and "expected format" in err.message
    assert not any(isinstance(e, Finished) for e in events)


async def test_ls_stream_cut_without_finish_is_an_error(replay):
    replay.parts = sse(delta(content="half an ans"))
    events = await collect(replay.url)
    assert isinstance(events[-1], BackendError)
    assert "before the answer finished" in events[-1].message


@pytest.mark.parametrize("status,body,needle,retry", [
    (400, {"error": {"code": 400, "message": "request (3024 tokens) exceeds the available "
                     "context size (1024 tokens), try increasing it",
                     "type": "exceed_context_size_error"}}, "shorter (ctrl+e)", False),
    (401, {"error": {"code": 401, "message": "Invalid API Key",
                     "type": "authentication_error"}}, "API key", False),
    (503, {"error": {"code": 503, "message": "the server is busy: 8 requests are already "
                     "waiting", "type": "unavailable_error"}}, "busy with other requests", True),
])
async def test_ls_http_errors_become_one_sentence_and_next_step(replay, status, body, needle,
                                                                retry):
    """…and say whether the same request again could succeed: a conversation over the
    context and a wrong key fail again until the user changes them."""
    replay.status, replay.parts = status, [json.dumps(body).encode()]
    events = await collect(replay.url)
    assert len(events) == 1 and isinstance(events[0], BackendError)
    assert body["error"]["message"] in events[0].message and needle in events[0].next_step
    assert events[0].retry is retry


async def test_ls_loading_server_waits_then_sends_the_prompt(replay):
    import asyncio

    loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    replay.status, replay.parts = 503, [json.dumps(loading).encode()]
    events: list = []

    async def run():
        async for ev in stream_chat(replay.url, [{"role": "user", "content": "hi"}]):
            events.append(ev)

    task = asyncio.create_task(run())
    for _ in range(1500):
        if events:
            break
        await asyncio.sleep(0.02)
    assert isinstance(events[0], Waiting) and "still loading" in events[0].message
    await asyncio.sleep(1.5)  # /health still says 503: the client keeps waiting
    assert not task.done() and len(events) == 1
    replay.parts = sse(delta(content="ready now"), {"choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}]}, b"data: [DONE]\n\n")
    replay.status = 200
    await asyncio.wait_for(task, 30)
    assert texts(events, ContentDelta) == "ready now" and isinstance(events[-1], Finished)
    assert len(replay.requests) == 2  # the prompt was sent again once, when ready


async def test_ls_server_dying_while_loading_is_a_backend_error(replay):
    import asyncio

    loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    replay.status, replay.parts = 503, [json.dumps(loading).encode()]
    gen = stream_chat(replay.url, [{"role": "user", "content": "hi"}])
    assert isinstance(await gen.__anext__(), Waiting)
    replay.stop()
    last = await asyncio.wait_for(gen.__anext__(), 30)
    assert isinstance(last, BackendError) and "stopped answering while it loaded" in last.message
    await gen.aclose()


async def test_ls_connection_refused_is_a_backend_error():
    from llama_helpers import refused_port

    with refused_port() as port:  # held, so no other program can start listening there
        events = await collect(f"http://127.0.0.1:{port}/v1")
    assert len(events) == 1 and isinstance(events[0], BackendError)
    assert "Could not connect" in events[0].message


async def test_ls_aclose_closes_the_http_stream(replay):
    # 2000 parts take >= 20 s to stream: a server that stopped early saw the client go
    replay.parts = sse(*[delta(content=f"{i} ") for i in range(2000)])
    replay.delay_s = 0.01
    gen = stream_chat(replay.url + "/v1/", [{"role": "user", "content": "x"}])
    seen = 0
    async for ev in gen:
        seen += isinstance(ev, ContentDelta)
        if seen == 3:
            break
    await gen.aclose()
    import asyncio

    for _ in range(1500):  # 30 s: a loaded box may be slow to see the connection go
        if replay.closed.is_set():
            break
        await asyncio.sleep(0.02)
    assert replay.closed.is_set() and replay.sent < len(replay.parts), \
        f"server kept streaming after the client closed ({replay.sent} parts sent)"


async def test_ls_health_and_models_helpers(replay):
    assert await health(replay.url + "/v1")
    replay.status = 503
    h = await health(replay.url)
    assert not h and h.status == 503


def test_ls_url_and_request_shapes():
    assert api_base("http://h:1") == api_base("http://h:1/") == api_base("http://h:1/v1/") \
        == "http://h:1/v1"
    body = build_request([{"role": "user", "content": "x"}], max_tokens=3, temperature=0.5,
                         extra={"chat_template_kwargs": {"enable_thinking": False}})
    assert body["temperature"] == 0.5 and body["chat_template_kwargs"]["enable_thinking"] is False


def test_ls_interpreter_counts_tokens_from_cumulative_timings():
    ticks = iter(range(100))
    it = ChunkInterpreter(clock=lambda: float(next(ticks)))
    a = it.chunk({**delta(content="a"), "timings": {"predicted_n": 1, "predicted_ms": 2.0}})
    b = it.chunk({**delta(content="bc"), "timings": {"predicted_n": 3, "predicted_ms": 8.0}})
    assert a[-1].tokens == 1 and a[-1].backend_ms == 2.0
    assert b[-1].tokens == 2 and b[-1].backend_ms == 3.0 and b[-1].arrival_s == 1.0
    assert it.data("not json")[0].message.startswith("The backend sent")


def test_every_chunks_token_ids_become_an_event_even_without_text():
    """The engine's `k3.token_ids`: ids of hidden tags arrive in chunks with no text, and the
    last chunk carries any still unsent; a reply is sent back (and continued) by them."""
    from k3tui.backends.events import TokenIds

    it = ChunkInterpreter()
    chunks = [{"choices": [{"delta": {"reasoning_content": "hm"}}], "k3": {"token_ids": [7]}},
              {"choices": [{"delta": {}}], "k3": {"token_ids": [8, 9]}},
              {"choices": [{"delta": {"content": "ok"}, "finish_reason": "stop"}],
               "k3": {"token_ids": [10]}},
              {"choices": [], "k3": {"token_ids": [2]}}]
    ids = [i for c in chunks for ev in it.chunk(c) if isinstance(ev, TokenIds) for i in ev.ids]
    assert ids == [7, 8, 9, 10, 2]
    for bad in ([1, "2"], [-1], [True], "12", [2**40], list(range(5000))):
        assert not [ev for ev in it.chunk({"choices": [], "k3": {"token_ids": bad}})
                    if isinstance(ev, TokenIds)]
