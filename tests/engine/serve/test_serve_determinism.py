"""An answer is a function of the request alone: the same request to a server that has
just served the turn before (its states kept) and to a cold one gives the same ids, also
when the earlier reply's text does not encode back to the ids the model generated."""

from __future__ import annotations

import argparse
import json
from collections import deque

import httpx
import pytest

from engine.decode.steer import end_of_answer, only, think_to_response
from engine.commands.serve import add_arguments
from engine.serve.routes import Service
from engine.serve.worker import LoadProgress, LoadSettings, load_engine
from engine.text.chat_template import ChatTemplate
from engine.text.tokenizer import Tokenizer
from tests.engine.serve.conftest import InProcServer
from tests.engine.serve.test_serve_process import CHAT, small_ckpt  # noqa: F401

FIRST = [{"role": "user", "content": "Hello there"}]


def loaded_engine(ckpt, *flags):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(ckpt), *flags])
    return load_engine(ckpt, ckpt, LoadSettings.from_args(args), LoadProgress(), args.ctx_size)


def scripted(loaded, script: list[int]):
    """The loaded engine, and `arm()`: the next generation after it is forced to write
    `script` (the real forward pass runs and its states are kept; only the ids are
    forced)."""
    real, todo = loaded.generate, deque()

    def gen(prompt_ids, params, cancel=None, logits_hook=None, owner="", keep_at=()):
        hook = logits_hook
        if todo:
            def hook(generated, logits):
                return only(todo.popleft(), logits)
        return real(prompt_ids, params, cancel=cancel, logits_hook=hook, owner=owner,
                    keep_at=keep_at)

    loaded.generate = gen
    return loaded, lambda: todo.extend(script)


def not_round_tripping(tok) -> list[int]:
    """A whole reply whose text renders to other ids than these: a byte that starts a
    three-byte character followed by a word (the text gets a `\\xe4` escape), and a
    word split where BPE would not split it."""
    byte = next(i for i in range(tok.n_ranks) if tok.id_to_bytes(i) == b"\xe4")
    word = next(w for w in (" the", " and", " of") if len(tok.encode(w)) == 1)
    split = tok.encode(word[:2]) + tok.encode(word[2:])
    assert tok.encode(tok.decode(split)) != split
    return ([*tok.encode("Hmm"), byte, *tok.encode(" yes"), *think_to_response(tok),
             *tok.encode("It is"), *split, *tok.encode(" sea.")] + end_of_answer(tok))


def serve(loaded):
    service = Service(model_name="k3-small", steer_demo=False, reasoning_budget=-1,
                      api_keys=[])
    return InProcServer(service, loaded)


def ask(srv, messages, max_tokens=8, extra=None):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 1,
            **(extra or {})}
    resp = httpx.post(srv.url + CHAT, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def servers(small_ckpt):  # noqa: F811
    warm_loaded = loaded_engine(small_ckpt)
    script = not_round_tripping(warm_loaded.tok)
    loaded, arm = scripted(warm_loaded, script)
    warm = serve(loaded)
    cold = serve(loaded_engine(small_ckpt, "--snapshot-gb", "0"))
    yield warm, cold, script, arm, small_ckpt
    warm.stop()
    cold.stop()


def test_srv_same_request_same_answer_warm_or_cold(servers):
    warm, cold, script, arm, _ = servers
    arm()
    first = ask(warm, FIRST, max_tokens=len(script))
    reply = first["choices"][0]["message"]
    assert first["usage"]["completion_tokens"] == len(script)
    assert "\\xe4" in reply["reasoning_content"]
    props = httpx.get(warm.url + "/props", timeout=30).json()["prompt_reuse"]
    assert props["replies_not_round_trip"] == 1

    second = FIRST + [reply, {"role": "user", "content": "And then?"}]
    w, c = ask(warm, second), ask(cold, second)
    assert w["choices"][0]["message"] == c["choices"][0]["message"]
    assert w["usage"]["prompt_tokens"] == c["usage"]["prompt_tokens"]
    assert c["timings"]["cache_n"] == 0
    # the reply is prefilled again, and only the reply: the first prompt is resumed
    assert w["timings"]["cache_n"] == first["timings"]["prompt_n"]


def test_srv_a_reply_that_does_not_round_trip_is_prefilled_once(servers, small_ckpt):  # noqa: F811
    """An edited follow-up (another question after the same reply) resumes at the end
    of the reply as its text renders, kept when the reply was prefilled again."""
    warm, cold, script, arm, _ = servers
    arm()
    reply = ask(warm, FIRST, max_tokens=len(script))["choices"][0]["message"]
    ask(warm, FIRST + [reply, {"role": "user", "content": "And then?"}])
    edited = FIRST + [reply, {"role": "user", "content": "Why though?"}]
    w, c = ask(warm, edited), ask(cold, edited)
    assert w["choices"][0]["message"] == c["choices"][0]["message"]
    ends = ChatTemplate(Tokenizer.from_dir(small_ckpt)).render_full(edited).reply_ends
    assert w["timings"]["cache_n"] == ends[-1]


def stream_ids(srv, body) -> tuple[list[int], dict]:
    """The ids of a streamed answer, chunk by chunk, and its final chunk."""
    with httpx.stream("POST", srv.url + CHAT, json={**body, "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        chunks = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    return [i for c in chunks for i in c["k3"]["token_ids"]], chunks[-1]


def test_srv_token_ids_out_and_back_resume_in_full(servers):
    """Every id reaches the client (streamed or not); sent back with the reply, the next
    turn renders the reply as those ids, resumes all of it, and is still the cold answer."""
    warm, cold, script, arm, _ = servers
    arm()
    first = ask(warm, FIRST, max_tokens=len(script))
    assert first["k3"]["token_ids"] == script
    arm()
    streamed, final = stream_ids(warm, {"messages": FIRST, "max_tokens": len(script),
                                        "temperature": 0, "seed": 1})
    assert streamed == script and final["choices"][0]["finish_reason"] == "stop"
    reply = {**first["choices"][0]["message"], "k3_token_ids": script}
    second = FIRST + [reply, {"role": "user", "content": "And then?"}]
    w, c = ask(warm, second), ask(cold, second)
    assert w["k3"]["token_ids"] == c["k3"]["token_ids"]
    assert w["choices"][0]["message"] == c["choices"][0]["message"]
    t1 = first["timings"]
    assert w["timings"]["cache_n"] == t1["cache_n"] + t1["prompt_n"] + len(script) - 1


@pytest.mark.parametrize("bad, why", [
    ([0, "x"], "token ids from 0"),
    ([10**9], "token ids from 0"),
    ("12", "must be an array"),
    ([5, 6, 7], "do not give its reasoning_content and content"),
])
def test_srv_token_ids_that_are_not_the_message_are_refused(servers, bad, why):
    warm = servers[0]
    msgs = FIRST + [{"role": "assistant", "content": "Hi", "k3_token_ids": bad},
                    {"role": "user", "content": "More"}]
    resp = httpx.post(warm.url + CHAT, json={"messages": msgs, "max_tokens": 2}, timeout=60)
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "message 1 (assistant)" in message and why in message, message


def parsed(tok, ids) -> tuple[str, str]:
    """The text a stream cut right after `ids` gave the client."""
    parser = ChatTemplate(tok).parser(thinking=True)
    deltas = [parser.feed(i) for i in ids]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}])
def test_srv_partial_answer_continues_as_the_uninterrupted_run(servers, sampling):
    """The first k ids of an answer sent back as a partial assistant turn: the rest equals
    the uninterrupted run, ids and text, for k inside the reasoning, inside the tags of
    the think/response switch the reasoning budget forces, right after them, and inside
    the answer."""
    warm, cold = servers[0], servers[1]
    budget, n = 5, 20
    body = {"messages": FIRST, "max_tokens": n, "reasoning_budget_tokens": budget,
            "ignore_eos": True, **sampling}
    whole, _ = stream_ids(cold, body)
    tok = Tokenizer.from_dir(servers[4])
    switch = budget + len(think_to_response(tok))
    assert len(whole) == n and whole[budget:switch] == think_to_response(tok)
    full = parsed(tok, whole)
    for k in (2, budget + 1, switch, switch + 3):  # budget + 1: inside the forced tags
        reasoning, content = parsed(tok, whole[:k])
        turn = {"role": "assistant", "reasoning_content": reasoning, "content": content,
                "partial": True, "k3_token_ids": whole[:k]}
        for srv in (warm, cold):
            rest = ask(srv, FIRST + [turn], max_tokens=n - k, extra={
                "reasoning_budget_tokens": budget, "ignore_eos": True, **sampling})
            message = rest["choices"][0]["message"]
            assert whole[:k] + rest["k3"]["token_ids"] == whole, k
            assert reasoning + (message.get("reasoning_content") or "") == full[0]
            assert content + message["content"] == full[1]
