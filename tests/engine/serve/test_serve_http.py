"""The HTTP layer over loopback (uvicorn in a thread, a small numpy generator with
engine.generate's contract): chunk shapes, errors, budget, stop, cancel, queueing."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import httpx
import pytest

TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
               "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
K3_KEYS = {"s_per_token", "gb_read", "mb_per_s", "true_hit_rate", "rss_gb", "budget_gb",
           "compute_s", "wait_trunk_s", "wait_experts_s"}
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
# httpx's default is 5 s per call: a demo reply of a few hundred tokens on a loaded 2-core
# box must not turn into a ReadTimeout. Tests that time out on purpose pass their own.
TIMEOUT = 60.0
get = functools.partial(httpx.get, timeout=TIMEOUT)
post = functools.partial(httpx.post, timeout=TIMEOUT)
request = functools.partial(httpx.request, timeout=TIMEOUT)


def stream_lines(url: str, body: dict, **kw) -> list[str]:
    with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=30, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def chunks_of(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def texts(chunks: list[dict]) -> tuple[str, str]:
    r = c = ""
    for ch in chunks:
        for choice in ch.get("choices", []):
            r += choice["delta"].get("reasoning_content") or ""
            c += choice["delta"].get("content") or ""
    return r, c


def metric(url: str, name: str) -> float:
    for line in get(url + "/metrics").text.splitlines():
        if line.startswith(f"k3_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no k3_{name}")


def test_srv_stream_shape_like_llama_server(inproc):
    srv = inproc(steer_demo=True)
    lines = stream_lines(srv.url, {"messages": HI, "seed": 7, "max_tokens": 300,
                                   "stream_options": {"include_usage": True}})
    assert lines[-1] == "data: [DONE]"
    chunks = chunks_of(lines)
    first, finish, usage = chunks[0], chunks[-2], chunks[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(K3_KEYS <= set(c["k3"]) for c in chunks)  # every chunk carries k3
    assert first["k3"]["s_per_token"] is None  # null where unknown
    assert len({c["id"] for c in chunks}) == 1 and first["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-k3" for c in chunks)
    assert finish["choices"][0] == {"finish_reason": "stop", "index": 0, "delta": {}}
    assert usage["choices"] == [] and set(usage["timings"]) == TIMING_KEYS
    assert (
        usage["usage"]["total_tokens"]
        == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]
    )
    assert usage["timings"]["predicted_n"] == usage["usage"]["completion_tokens"]
    assert "timings" not in finish  # timings ride on the last chunk only
    middle = chunks[1:-2]
    for c in middle:
        assert len(c["choices"][0]["delta"]) == 1 and K3_KEYS <= set(c["k3"])
    kinds = ["r" if "reasoning_content" in c["choices"][0]["delta"] else "c" for c in middle]
    # reasoning first, then content, never interleaved
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds
    reasoning, content = texts(chunks)
    assert "<|" not in reasoning + content and "think" not in content
    assert usage["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_srv_non_streamed_and_demo_is_deterministic(inproc):
    srv = inproc(steer_demo=True)
    body = {"messages": HI, "seed": 11, "max_tokens": 300}
    a = post(srv.url + CHAT, json=body, timeout=30).json()
    b = post(srv.url + CHAT, json=body, timeout=30).json()
    c = post(srv.url + CHAT, json={**body, "seed": 12}, timeout=30).json()
    assert a["object"] == "chat.completion"
    msg = a["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] and msg["reasoning_content"]
    assert msg == b["choices"][0]["message"] and msg != c["choices"][0]["message"]
    assert a["choices"][0]["finish_reason"] == "stop"
    assert set(a["timings"]) == TIMING_KEYS and a["usage"]["completion_tokens"] > 10
    assert "demo model" in a["k3"]["demo"]
    words = msg["content"].replace(".", " ").replace(",", " ").split()
    assert all(w.isalpha() for w in words)  # readable words only


def test_srv_thinking_off_and_effort(inproc):
    srv = inproc(steer_demo=True)
    for extra in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ):
        out = post(
            srv.url + CHAT, json={"messages": HI, "seed": 1, "max_tokens": 200, **extra}
        ).json()
        msg = out["choices"][0]["message"]
        assert "reasoning_content" not in msg and msg["content"]
    r = post(srv.url + CHAT, json={"messages": HI, "reasoning_effort": "medium"})
    assert r.status_code == 400 and "low, high or max" in r.json()["error"]["message"]
    low = post(
        srv.url + CHAT, json={"messages": HI, "reasoning_effort": "low", "max_tokens": 5}
    ).json()
    high = post(
        srv.url + CHAT, json={"messages": HI, "reasoning_effort": "high", "max_tokens": 5}
    ).json()
    off = post(
        srv.url + CHAT, json={"messages": HI, "reasoning_effort": "none", "max_tokens": 5}
    ).json()
    # the effort option message is in the prompt when thinking is on
    assert low["usage"]["prompt_tokens"] > off["usage"]["prompt_tokens"] + 50
    assert high["usage"]["prompt_tokens"] > off["usage"]["prompt_tokens"] + 50


def test_srv_length_inside_reasoning_says_so(inproc):
    srv = inproc(steer_demo=True)
    out = post(srv.url + CHAT, json={"messages": HI, "max_tokens": 8, "seed": 8}).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["message"]["content"] == ""
    assert "ran out while the model was still reasoning" in out["k3"]["note"]
    lines = stream_lines(srv.url, {"messages": HI, "max_tokens": 8, "seed": 8})
    assert "still reasoning" in chunks_of(lines)[-1]["k3"]["note"]


def close_think_len(tok) -> int:
    from engine.decode.steer import tag_ids

    return len(tag_ids(tok, "<|close|>", "think"))


def test_srv_reasoning_budget_forces_the_answer(inproc, test_tok):
    srv = inproc(steer_demo=True)
    # the demo would think ~24+ tokens; a budget of 6 closes the think channel early
    out = post(
        srv.url + CHAT,
        json={"messages": HI, "seed": 3, "max_tokens": 300, "reasoning_budget_tokens": 6},
    ).json()
    msg = out["choices"][0]["message"]
    assert msg["content"] and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6 + close_think_len(
        test_tok
    )
    assert len(msg["reasoning_content"].split()) <= 6
    zero = post(
        srv.url + CHAT,
        json={"messages": HI, "seed": 3, "max_tokens": 300, "reasoning_budget_tokens": 0},
    ).json()
    assert "reasoning_content" not in zero["choices"][0]["message"]
    assert zero["choices"][0]["message"]["content"]


def test_srv_server_default_budget(inproc, test_tok):
    srv = inproc(steer_demo=True, reasoning_budget=4)
    out = post(srv.url + CHAT, json={"messages": HI, "max_tokens": 300, "seed": 4}).json()
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4 + close_think_len(
        test_tok
    )
    assert (
        get(srv.url + "/props").json()["default_generation_settings"]["params"][
            "reasoning_budget_tokens"
        ]
        == 4
    )


def test_srv_stop_strings(inproc):
    srv = inproc(steer_demo=True)
    full = post(
        srv.url + CHAT,
        json={"messages": HI, "seed": 5, "max_tokens": 300, "reasoning_effort": "none"},
    ).json()
    content = full["choices"][0]["message"]["content"]
    stop = content.split()[3]
    cut = post(
        srv.url + CHAT,
        json={
            "messages": HI,
            "seed": 5,
            "max_tokens": 300,
            "reasoning_effort": "none",
            "stop": [stop, "zzzz"],
        },
    ).json()
    assert cut["choices"][0]["message"]["content"] == content[: content.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    lines = stream_lines(
        srv.url,
        {"messages": HI, "seed": 5, "max_tokens": 300, "reasoning_effort": "none", "stop": stop},
    )
    assert texts(chunks_of(lines))[1] == content[: content.index(stop)]


@pytest.mark.parametrize(
    "body, code, kind, words",
    [
        (b"{not json", 400, "invalid_request_error", "not valid JSON"),
        ({"messages": []}, 400, "invalid_request_error", "messages"),
        ({"messages": HI, "max_tokens": "many"}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": HI, "temperature": -1}, 400, "invalid_request_error", "temperature"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error", "role"),
        ({"messages": HI, "n": 2}, 400, "invalid_request_error", "'n' must be 1"),
        (
            {"messages": HI, "tools": [{"type": "function"}]},
            400,
            "invalid_request_error",
            "tool calling",
        ),
        (
            {"messages": HI, "reasoning_effort": "minimal"},
            400,
            "invalid_request_error",
            "low, high or max",
        ),
        (
            {"messages": [{"role": "user", "content": "word " * 5000}]},
            400,
            "exceed_context_size_error",
            "exceeds the available context size",
        ),
    ],
)
def test_srv_error_shapes(inproc, body, code, kind, words):
    srv = inproc()
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = post(srv.url + CHAT, **kw)
    err = r.json()["error"]
    assert r.status_code == code == err["code"] and err["type"] == kind and words in err["message"]
    if kind == "exceed_context_size_error":
        assert err["n_ctx"] == 4096 and err["n_prompt_tokens"] > 4096


def test_srv_unknown_route_and_method(inproc):
    srv = inproc()
    r = get(srv.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = get(srv.url + CHAT)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_srv_error_after_streaming_started_is_an_error_chunk(inproc):
    srv = inproc(fail_at=3)
    lines = stream_lines(srv.url, {"messages": HI, "max_tokens": 50})
    assert lines[-1] != "data: [DONE]"
    err = json.loads(lines[-1][6:])["error"]
    assert (
        err["code"] == 500
        and err["type"] == "server_error"
        and "simulated engine failure" in err["message"]
    )
    assert metric(srv.url, "requests_failed_total") == 1
    r = post(srv.url + CHAT, json={"messages": HI, "max_tokens": 50})
    assert r.status_code == 500 and "simulated" in r.json()["error"]["message"]


def test_srv_api_key(inproc):
    srv = inproc(api_keys=["k1", "k2"])
    assert get(srv.url + "/health").status_code == 200  # public, like llama-server
    r = get(srv.url + "/v1/models")
    assert r.status_code == 401 and r.json() == {
        "error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
    }
    assert get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert get(srv.url + "/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert get(srv.url + "/metrics", headers={"X-Api-Key": "k1"}).status_code == 200
    r = post(
        srv.url + CHAT,
        json={"messages": HI, "max_tokens": 2},
        headers={"Authorization": "Bearer k1"},
    )
    assert r.status_code == 200


def test_srv_loading_is_503_everywhere_but_health_with_progress(inproc, make_loaded):
    srv = inproc(loaded=False)
    r = get(srv.url + "/health")
    body = r.json()
    assert r.status_code == 503 and body["error"] == {
        "code": 503,
        "message": "Loading model",
        "type": "unavailable_error",
    }
    assert {
        "phase",
        "elapsed_s",
        "bytes_read",
        "checkpoint_bytes",
        "layers_bound",
        "rss_gb",
    } <= set(body["progress"])
    for method, path in (("POST", CHAT), ("GET", "/v1/models"), ("GET", "/props")):
        r = request(method, srv.url + path, json={"messages": HI})
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
    assert metric(srv.url, "model_loaded") == 0
    srv.service.set_loaded(make_loaded())
    assert get(srv.url + "/health").json() == {"status": "ok"}
    assert metric(srv.url, "model_loaded") == 1


def test_srv_models_and_props_say_demo(inproc):
    srv = inproc(steer_demo=True)
    models = get(srv.url + "/v1/models").json()
    entry = models["data"][0]
    assert models["object"] == "list" and entry["object"] == "model"
    assert entry["owned_by"] == "demo model — random weights, not Kimi-K3"
    props = get(srv.url + "/props").json()
    assert props["demo"] is True and "random weights, not Kimi-K3" in props["description"]
    assert props["memory_plan"] == {"mode": "resident"} and props["total_slots"] == 1


def wait_metrics(url: str, what: str, **want: float) -> None:
    """Poll /metrics until every k3_<name> equals its wanted value (30 s on a slow box)."""
    deadline = time.monotonic() + 30
    while any(metric(url, name) != value for name, value in want.items()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {want}"
        time.sleep(0.02)


def test_srv_cancel_on_disconnect_stops_generation(inproc):
    counter: list[int] = []
    srv = inproc(delay=0.05, counter=counter)
    with httpx.stream(
        "POST",
        srv.url + CHAT,
        json={"messages": HI, "max_tokens": 2000, "stream": True},
        timeout=TIMEOUT,
    ) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
            if got >= 4 and len(counter) >= 4:
                break
    # the client closed the connection: generation stops within about one token
    wait_metrics(srv.url, "the generation to stop", requests_processing=0)
    assert metric(srv.url, "requests_cancelled_total") == 1
    frozen = metric(srv.url, "tokens_predicted_total")
    steps = len(counter)
    time.sleep(0.5)  # ~10 more tokens would have been generated
    assert metric(srv.url, "tokens_predicted_total") == frozen < 100
    assert len(counter) == steps
    # the slot is free again
    assert post(srv.url + CHAT, json={"messages": HI, "max_tokens": 2}).status_code == 200


async def async_metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    text = (await client.get(url + "/metrics")).text
    return float(text.split(f"\nk3_{name} ")[1].split()[0])


async def until_metric(client: httpx.AsyncClient, url: str, name: str, value: float) -> None:
    deadline = time.monotonic() + 30
    while await async_metric(client, url, name) != value:
        assert time.monotonic() < deadline, f"k3_{name} never became {value}"
        await asyncio.sleep(0.005)


async def test_srv_concurrent_request_waits_its_turn(inproc):
    # `a` holds the slot at its second token until the test has seen `b` waiting, so the
    # overlap does not depend on how fast a loaded machine generates 25 tokens.
    gate = threading.Event()
    srv = inproc(delay=0.02, gate=gate)
    events: list[tuple[str, float]] = []

    async def one(name: str, client: httpx.AsyncClient) -> None:
        body = {"messages": HI, "max_tokens": 25, "stream": True, "seed": 1}
        async with client.stream("POST", srv.url + CHAT, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"reasoning_content"' in line or '"content":"' in line:
                    events.append((name, time.monotonic()))
                if line == "data: [DONE]":
                    events.append((name + "-done", time.monotonic()))

    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        first = asyncio.create_task(one("a", client))
        await until_metric(client, srv.url, "requests_processing", 1)
        second = asyncio.create_task(one("b", client))
        await until_metric(client, srv.url, "requests_deferred", 1)  # b waits for the slot
        assert await async_metric(client, srv.url, "requests_processing") == 1
        assert not any(n.startswith("b") for n, _ in events)  # and has no token yet
        gate.set()
        await asyncio.gather(first, second)
    a_done = next(t for n, t in events if n == "a-done")
    b_first = min(t for n, t in events if n == "b")
    assert b_first >= a_done  # one generation at a time
    assert any(n == "b-done" for n, _ in events)


async def test_srv_too_many_waiting_is_503(inproc, monkeypatch):
    from engine.serve import scheduler

    monkeypatch.setattr(scheduler, "MAX_WAITING", 1)
    gate = threading.Event()  # the running request holds the slot until the 503 is seen
    srv = inproc(delay=0.01, gate=gate)
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        body = {"messages": HI, "max_tokens": 40}
        running = asyncio.create_task(client.post(srv.url + CHAT, json=body))
        await until_metric(client, srv.url, "requests_processing", 1)
        waiting = asyncio.create_task(client.post(srv.url + CHAT, json=body))
        await until_metric(client, srv.url, "requests_deferred", 1)
        r = await client.post(srv.url + CHAT, json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        assert "busy" in r.json()["error"]["message"]
        gate.set()
        assert (await running).status_code == 200 and (await waiting).status_code == 200


def test_srv_non_streamed_client_timeout_cancels(inproc):
    counter: list[int] = []
    srv = inproc(delay=0.05, counter=counter)
    with pytest.raises(httpx.ReadTimeout):  # only the read gives up early, not the connect
        post(
            srv.url + CHAT,
            json={"messages": HI, "max_tokens": 2000},
            timeout=httpx.Timeout(TIMEOUT, read=0.4),
        )
    # the cancel is counted a moment before the slot is marked idle: wait for both
    wait_metrics(srv.url, "the cancel", requests_cancelled_total=1, requests_processing=0)
    steps = len(counter)
    time.sleep(0.3)
    assert len(counter) == steps < 100


def test_srv_tokenize_detokenize_apply_template(inproc, test_tok):
    srv = inproc()
    text = "Hello <|open|> 你好"
    tokens = post(srv.url + "/tokenize", json={"content": text}).json()["tokens"]
    assert tokens == test_tok.encode(text) and all(t < test_tok.n_ranks for t in tokens)
    assert post(srv.url + "/detokenize", json={"tokens": tokens}).json() == {"content": text}
    out = post(srv.url + "/apply-template", json={"messages": HI, "reasoning_effort": "low"}).json()
    assert out["prompt"].startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    assert out["prompt"].endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert "thinking_effort=low" in out["prompt"] and out["n_tokens"] > 50
    r = post(srv.url + "/detokenize", json={"tokens": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_srv_random_weights_stream_no_replacement_or_control_chars(inproc):
    """Random ids (the demo without --steer-demo) are invalid UTF-8 and control bytes
    often: each is escaped as text (\\xNN), never U+FFFD nor a raw BEL/ESC."""
    import re

    srv = inproc(steer_demo=False)
    out = ""
    for seed in (1, 2, 3):
        reasoning, content = texts(chunks_of(stream_lines(
            srv.url, {"messages": HI, "seed": seed, "max_tokens": 200})))
        out += reasoning + content
    assert "\\x" in out  # the random ids did produce bytes to escape
    assert "\ufffd" not in out
    assert not re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]", out), repr(out)


@pytest.mark.parametrize("thinking", [True, False])
def test_srv_a_tag_cut_by_the_limit_or_an_end_never_reaches_the_answer(inproc, test_tok, thinking):
    """`max_tokens`, or an end id, after any id of any tag but its `<|sep|>`: the streamed
    and the collected answer are the text before the tag (the tag is held back while it
    is read, and dropped when the end cuts it)."""
    from tests.engine.text.test_text_chat_template import _reply

    ids, tags = _reply(test_tok, thinking)
    script: list[int] = []
    srv = inproc(script=script)
    mode = {} if thinking else {"reasoning_effort": "none"}
    for start, sep, reasoning, content in tags:
        for cut in range(start + 1, sep + 1):
            for how, fed, max_tokens in (("length", ids, cut),
                                         ("stop", ids[:cut] + [test_tok.special("[EOS]")], 99)):
                script[:] = fed
                body = {"messages": HI, "max_tokens": max_tokens, **mode}
                chunks = chunks_of(stream_lines(srv.url, body))
                finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
                said = test_tok.decode(ids[start:cut])
                assert finish[-1] == how and texts(chunks) == (reasoning, content), said
                msg = post(srv.url + CHAT, json=body).json()["choices"][0]["message"]
                assert (msg.get("reasoning_content", ""), msg["content"]) == (reasoning, content)


def test_srv_a_tag_cut_by_a_cancel_never_reaches_the_answer(test_tok):
    """Cancelled after any id of a tag: no text of the tag was emitted before the stop."""
    from engine.serve.protocol import Stopped, Token, parse_chat_request
    from engine.serve.worker import Job, Loaded, Metrics, run_job
    from engine.text.chat_template import ChatTemplate
    from tests.engine.serve.conftest import FakeParams, scripted_generate
    from tests.engine.text.test_text_chat_template import _reply

    ids, tags = _reply(test_tok, True)
    loaded = Loaded(tok=test_tok, generate=scripted_generate(ids), make_params=FakeParams,
                    n_ctx=4096)
    template = ChatTemplate(test_tok)
    for start, sep, reasoning, content in tags:
        for cut in range(start + 1, sep + 1):
            job = Job(parse_chat_request({"messages": HI}, -1), [1, 2, 3], max_new=99)
            events = []

            def emit(event, job=job, events=events, cut=cut):
                events.append(event)
                if sum(isinstance(e, Token) for e in events) == cut:
                    job.cancel.set()  # what the client going away does, between two tokens

            run_job(job, loaded, template, Metrics(), False, emit)
            assert isinstance(events[-1], Stopped) and job.finish == "cancelled"
            tokens = [e for e in events if isinstance(e, Token)]
            got = ("".join(e.reasoning for e in tokens), "".join(e.content for e in tokens))
            assert got == (reasoning, content)
