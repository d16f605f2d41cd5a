"""The real `python -m engine serve` at Kimi-K3's real vocabulary (163,840 ids: the test
tokenizer with the real shapes) on a narrow checkpoint the tests can afford: the
tokenizer, template, detokeniser and sampler at the real width, and prompt reuse after a
reply the token limit cut (issue 15) whose text does not encode back to its ids."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx
import pytest

from engine.checkpoint.synth import synthesize
from tests.engine.serve.test_serve_process import CHAT, ServeProcess

RAW_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@pytest.fixture(scope="module")
def real_vocab_server(tmp_path_factory):
    ckpt: Path = synthesize(tmp_path_factory.mktemp("srv_real_vocab"), "small",
                            overrides={"vocab_size": 163_840})
    srv = ServeProcess(str(ckpt), "--port", "0", timeout=120)
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)


def chat(srv, messages):
    body = {"messages": messages, "max_tokens": 24, "temperature": 0.8, "seed": 3,
            "stream": False}
    resp = httpx.post(srv.url + CHAT, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_srv_real_vocab_chat_detokenises_and_reuses_the_cut_reply(real_vocab_server):
    srv = real_vocab_server
    props = httpx.get(srv.url + "/props", timeout=30).json()
    assert props["end_token_ids"] == [163586, 163585]
    meta = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["meta"]
    assert meta["n_vocab"] == meta["n_vocab_model"] == 163_840
    text = "Zürich 机器学习 😀 <|open|>"
    ids = httpx.post(srv.url + "/tokenize", json={"content": text}, timeout=30).json()["tokens"]
    assert all(i < 163_584 for i in ids)  # special strings in text stay text
    back = httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back["content"] == text

    msgs = [{"role": "user", "content": "Hello! Où est le phare ? 你好"}]
    first = chat(srv, msgs)
    message = first["choices"][0]["message"]
    reply = (message.get("reasoning_content") or "") + (message.get("content") or "")
    assert first["choices"][0]["finish_reason"] == "length" and reply
    assert "\ufffd" not in reply and not RAW_CONTROLS.search(reply), repr(reply)
    msgs += [message, {"role": "user", "content": "And then?"}]
    t1, t2 = first["timings"], chat(srv, msgs)["timings"]
    # the random model's ids re-encode otherwise: the follow-up renders the reply from its
    # text (as a cold server does) and prefills it again, after the resumed prompt
    props = httpx.get(srv.url + "/props", timeout=30).json()["prompt_reuse"]
    assert props["replies_not_round_trip"] >= 1
    assert t2["cache_n"] == t1["prompt_n"]
