"""The latency pane's prompt reuse: llama-server's `cache_n` (the engine sends the same)
becomes "reused N of M prompt tokens" with the prefill time."""

from __future__ import annotations

from k3tui.backends.events import Finished, TokenStats
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
