"""Prompt reuse through a real `python -m engine serve`: a follow-up prefills only what
is new (the previous prompt and the reply as generated are resumed), the response says so
as llama-server does, and --snapshot-gb 0 turns it off with a note."""

from __future__ import annotations

import argparse
import json
import signal

import httpx
import pytest

from engine.commands.serve import add_arguments
from engine.serve.protocol import End, parse_chat_request
from engine.serve.worker import (
    Job,
    LoadProgress,
    LoadSettings,
    Metrics,
    _Text,
    load_engine,
    run_job,
)
from engine.text.chat_template import ChatTemplate
from tests.engine.serve.test_serve_process import CHAT, ServeProcess, small_ckpt  # noqa: F401


def ask(srv, messages, stream=False):
    body = {"messages": messages, "max_tokens": 200, "seed": 1, "stream": stream}
    if not stream:
        return httpx.post(srv.url + CHAT, json=body, timeout=120).json()
    with httpx.stream("POST", srv.url + CHAT, json=body, timeout=120) as resp:
        chunks = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    final = chunks[-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    why = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    message = {"role": "assistant", "content": text, "reasoning_content": why}
    return {**final, "choices": [{"message": message}], "usage": None}


@pytest.fixture(scope="module")
def demo(small_ckpt):  # noqa: F811
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--steer-demo")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)


def test_srv_follow_up_resumes_prompt_and_reply(demo):
    assert httpx.get(demo.url + "/props").json()["prompt_reuse"]["on"] is True
    msgs = [{"role": "user", "content": "Hello there"}]
    first = ask(demo, msgs)
    t1 = first["timings"]
    assert t1["cache_n"] == 0 and first["k3"]["gb_read_prefill"] is not None
    last = first
    for n, stream in enumerate((False, True)):
        prev = last
        reply = prev["choices"][0]["message"]
        msgs += [reply, {"role": "user", "content": f"And then {n}?"}]
        last = ask(demo, msgs, stream=stream)
        t, t_prev = last["timings"], prev["timings"]
        # everything the previous turn consumed: its prompt and its reply but the end id
        assert t["cache_n"] == t_prev["cache_n"] + t_prev["prompt_n"] + t_prev["predicted_n"] - 1
        assert 0 < t["prompt_n"] < 60  # only the new user turn and the template around it
        assert "gb_read_prefill" in last["k3"]
    assert last["choices"][0]["message"]["content"]


def test_srv_follow_up_without_reasoning_still_resumes_the_prompt(demo):
    msgs = [{"role": "user", "content": "Tell me more"}]
    first = ask(demo, msgs)
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    second = ask(demo, msgs + [reply, {"role": "user", "content": "Why?"}])
    # the think channel renders empty now, so the reply's state no longer fits: the prompt's
    assert second["timings"]["cache_n"] == first["timings"]["prompt_n"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["timings"]["cache_n"]


def test_srv_snapshot_gb_zero_turns_reuse_off(small_ckpt):  # noqa: F811
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--steer-demo", "--snapshot-gb", "0")
    try:
        reuse = httpx.get(srv.url + "/props").json()["prompt_reuse"]
        assert reuse["on"] is False and "--snapshot-gb" in reuse["note"]
        msgs = [{"role": "user", "content": "Hello there"}]
        first = ask(srv, msgs)
        msgs += [first["choices"][0]["message"], {"role": "user", "content": "More?"}]
        assert ask(srv, msgs)["timings"]["cache_n"] == 0
    finally:
        srv.stop()


def test_srv_reply_the_model_ended_is_kept_before_the_client_hears_the_end(small_ckpt):  # noqa: F811
    """A streamed response that ends sets the job's cancel (the client is gone): the
    reply's state must be kept by then, or the follow-up resumes only the first prompt."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(small_ckpt), "--steer-demo"])
    settings = LoadSettings.from_args(args)
    loaded = load_engine(small_ckpt, small_ckpt, settings, LoadProgress(), args.ctx_size)
    template = ChatTemplate(loaded.tok)

    def turn(messages):
        req = parse_chat_request({"messages": messages, "seed": 1, "max_tokens": 200}, -1)
        prompt = template.render(req.messages)
        job, events = Job(req, prompt, max_new=200), []

        def emit(event):
            events.append(event)
            if isinstance(event, End):  # what EventStream does once the last chunk is out
                job.cancel.set()

        run_job(job, loaded, template, Metrics(), True, emit)
        text = _Text(template, req)
        reasoning = content = ""
        for i in job.generated:
            r, c, _ = text.feed(i)
            reasoning, content = reasoning + r, content + c
        reply = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        return job, reply

    msgs = [{"role": "user", "content": "hello there"}]
    first, reply = turn(msgs)
    assert first.finish == "stop" and first.generated[-1] in template.end_ids()  # self-ended
    second, _ = turn(msgs + [reply, {"role": "user", "content": "And then?"}])
    # the first prompt and the reply as generated, all but the end id (never fed)
    assert second.cache_n == len(first.prompt_ids) + len(first.generated) - 1


KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"


def keyed_ask(srv, messages, key=None):
    body = {"messages": messages, "max_tokens": 200, "seed": 1}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = httpx.post(srv.url + CHAT, json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out, out["choices"][0]["message"]


def test_srv_one_key_never_resumes_another_keys_states(small_ckpt):  # noqa: F811
    """Two keys on one server: B sending A's exact conversation (a secret in its system
    prompt, then A's reply and a follow-up) prefills it all, as a cold server would, and
    gets the cold server's answer; A still resumes its own."""
    keyed = ServeProcess(str(small_ckpt), "--port", "0", "--steer-demo",
                         "--api-key", f"{KEY_A},{KEY_B}")
    cold = ServeProcess(str(small_ckpt), "--port", "0", "--steer-demo", "--snapshot-gb", "0")
    try:
        first = [{"role": "system", "content": "The door code is 4817. Never tell it."},
                 {"role": "user", "content": "Hello there"}]
        a1, reply = keyed_ask(keyed, first, KEY_A)
        second = first + [reply, {"role": "user", "content": "And then?"}]
        a2, a_reply = keyed_ask(keyed, second, KEY_A)  # A resumes its prompt and reply
        t1 = a1["timings"]
        assert t1["cache_n"] == 0
        assert a2["timings"]["cache_n"] == t1["prompt_n"] + t1["predicted_n"] - 1

        def template(srv, key=None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(srv.url + "/apply-template", json={"messages": second},
                              headers=headers, timeout=60).json()

        assert template(keyed, KEY_B) == template(cold)  # A's reply ids are A's alone
        # B guesses A's whole conversation, then its first turn: cold both times
        b2, b_reply = keyed_ask(keyed, second, KEY_B)
        c2, c_reply = keyed_ask(cold, second)
        assert b2["timings"]["cache_n"] == 0 and b_reply == c_reply == a_reply
        prefilled = a2["usage"]["prompt_tokens"]
        assert b2["timings"]["prompt_n"] == c2["timings"]["prompt_n"] == prefilled
        b1, b_first = keyed_ask(keyed, first, KEY_B)
        assert b1["timings"]["cache_n"] == 0 and b_first == keyed_ask(cold, first)[1] == reply
        # and B's own states are B's: its follow-up resumes what B itself sent
        b3, _ = keyed_ask(keyed, second + [b_reply, {"role": "user", "content": "Why?"}], KEY_B)
        t2 = b2["timings"]
        assert b3["timings"]["cache_n"] == t2["prompt_n"] + t2["predicted_n"] - 1
    finally:
        assert keyed.stop() in (0, -signal.SIGTERM)
        assert cold.stop() in (0, -signal.SIGTERM)
