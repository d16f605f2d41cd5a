"""The latency pane's prompt reuse: llama-server's `cache_n` (the engine sends the same)
becomes "reused N of M prompt tokens" with the prefill time."""

from __future__ import annotations

from textual.widgets import Static
from tui_helpers import settle

from k3tui.backends.events import Finished, TokenStats
from scripted import ScriptedStream
from k3tui.tui.stats import LatencyStats


def test_tui_stats_reused_of_prompt_tokens():
    st = LatencyStats()
    st.start(0.0)
    st.on_token(TokenStats(arrival_s=1.0, tokens=1))
    st.on_finished(Finished("stop", timings={"cache_n": 293, "prompt_n": 42, "prompt_ms": 120.0}))
    snap = st.snapshot()
    assert (snap.reused, snap.prompt_total, snap.prompt_ms) == (293, 335, 120.0)


def test_tui_stats_no_cache_n_no_reuse_line():
    st = LatencyStats()
    st.start(0.0)
    st.on_finished(Finished("stop", timings={"prompt_n": 42, "cache_n": "lots"}))  # hostile
    assert st.snapshot().reused is None


async def test_tui_latency_pane_shows_reused_of_prompt_tokens(app_factory):
    """The Finished timings reach the pane: the line a user reads after a follow-up."""
    scripted = ScriptedStream("Hi.", prompt_tokens=42)

    async def stream(messages):
        async for ev in scripted(messages):
            if isinstance(ev, Finished):
                ev = Finished("stop", timings={"cache_n": 293, "prompt_n": 42,
                                               "prompt_ms": 120.0})
            yield ev

    app = app_factory(stream, clock=scripted.clock)
    async with app.run_test(size=(140, 45)) as pilot:
        await pilot.press(*"hello", "enter")
        await settle(app, pilot)
        pane = str(app.query_one("#lat-text", Static).content)
        assert "reused 293 of 335 prompt tokens, prefill 120 ms" in pane
