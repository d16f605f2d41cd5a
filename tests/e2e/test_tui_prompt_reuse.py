"""Two chat turns in the real app against a real `python -m engine serve`: the chat sends
the first answer back with its reasoning, so the engine resumes the prompt *and* the reply
as generated, and the latency pane says how many prompt tokens it reused."""

from __future__ import annotations

import signal

from textual.widgets import Static
from tui_helpers import build_app, wait_until

from k3tui.backends.events import Finished
from k3tui.backends.openai_stream import stream_chat
from tests.engine.serve.test_serve_process import ServeProcess, small_ckpt  # noqa: F401


async def test_tui_follow_up_resumes_the_reply_and_shows_the_reuse(tmp_path, small_ckpt):  # noqa: F811
    srv = ServeProcess(str(small_ckpt), "--port", "0", "--steer-demo")
    requests, timings = [], []

    async def stream(messages):
        requests.append(messages)
        async for ev in stream_chat(srv.url, messages, max_tokens=200, extra={"seed": 1}):
            if isinstance(ev, Finished):
                timings.append(ev.timings or {})
            yield ev

    try:
        app = build_app(tmp_path, stream)
        async with app.run_test(size=(140, 45)) as pilot:
            for n, prompt in enumerate(("Hello there", "And then?"), start=1):
                await pilot.press(*prompt, "enter")
                await wait_until(pilot, lambda n=n: len(timings) == n and not app.chat.generating,
                                 timeout=120)
            first, second = timings
            assert requests[1][1]["reasoning_content"]  # the first answer's, sent back
            # resumed: the first prompt and its reply as generated (all but the end id); with
            # the reasoning left out only the first prompt would be (tests/engine/serve)
            reused = first["prompt_n"] + first["predicted_n"] - 1
            assert second["cache_n"] == reused > first["prompt_n"]
            pane = str(app.query_one("#lat-text", Static).content)
            total = reused + second["prompt_n"]
            assert f"reused {reused} of {total} prompt tokens" in pane
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)
