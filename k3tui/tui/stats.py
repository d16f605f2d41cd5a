"""Latency maths for the latency pane: pure Python, no Textual, testable with a fake clock.

Per-token times come from the backend when it reports them (llama-server `timings`, the
engine's `k3.s_per_token`), else from the client's inter-arrival times.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from k3tui.backends.events import Finished, TokenStats


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def format_rate(ms_per_token: float | None) -> str:
    """Tokens per second when fast, seconds per token when slower than one a second."""
    if ms_per_token is None or ms_per_token <= 0:
        return "–"
    if ms_per_token < 1000:
        return f"{1000 / ms_per_token:.1f} tok/s"
    return f"{ms_per_token / 1000:.1f} s/token"


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "–"
    if ms >= 10_000:
        return f"{ms / 1000:.0f} s"
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    return f"{ms:.0f} ms"


@dataclass
class LatencySnapshot:
    tokens: int
    ttft_ms: float | None
    prefill_tok_s: float | None
    gen_ms_per_token: float | None     # mean over the generation so far
    p50_ms: float | None
    p95_ms: float | None
    source: str                        # "backend" or "client"
    series: list[float]                # per-token ms, newest last
    reused: int | None = None          # prompt tokens the backend resumed (llama's cache_n)
    prompt_total: int | None = None    # reused + prefilled
    prompt_ms: float | None = None


class LatencyStats:
    """Feed `start()` at request time, then every TokenStats / Finished event."""

    def __init__(self, window: int = 4096):
        self._series: deque[float] = deque(maxlen=window)
        self.version = 0               # bumps on every change; panes redraw when it moves
        self.start(None)

    def start(self, t_request: float | None) -> None:
        self.t_request = t_request
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.tokens = 0
        self.prompt_tokens: int | None = None
        self.prompt_ms: float | None = None
        self.cache_n: int | None = None
        self._backend_total_ms = 0.0
        self._backend_count = 0
        self._series.clear()
        self.version += 1

    def on_token(self, ev: TokenStats) -> None:
        count = max(1, ev.tokens)
        if self.t_first is None:
            self.t_first = ev.arrival_s
        elif ev.backend_ms is None and self.t_last is not None:
            gap = (ev.arrival_s - self.t_last) * 1000 / count
            self._series.extend([gap] * count)
        if ev.backend_ms is not None:
            self._series.extend([ev.backend_ms] * count)
            self._backend_total_ms += ev.backend_ms * count
            self._backend_count += count
        if ev.prompt_ms is not None:
            self.prompt_ms = ev.prompt_ms
        if ev.prompt_tokens is not None:
            self.prompt_tokens = ev.prompt_tokens
        self.t_last = ev.arrival_s
        self.tokens += count
        self.version += 1

    def on_finished(self, ev: Finished) -> None:
        """llama-server's final `timings` are authoritative for prefill."""
        t = ev.timings or {}
        if t.get("prompt_ms") is not None:
            self.prompt_ms = float(t["prompt_ms"])
        if t.get("prompt_n") is not None:
            self.prompt_tokens = int(t["prompt_n"])
        if isinstance(t.get("cache_n"), int) and t["cache_n"] >= 0:
            self.cache_n = t["cache_n"]
        usage = ev.usage or {}
        if self.prompt_tokens is None and usage.get("prompt_tokens") is not None:
            self.prompt_tokens = int(usage["prompt_tokens"])
        self.version += 1

    def snapshot(self) -> LatencySnapshot:
        series = list(self._series)
        ttft = None
        if self.t_first is not None and self.t_request is not None:
            ttft = (self.t_first - self.t_request) * 1000
        prefill = None
        prompt_ms = self.prompt_ms if self.prompt_ms is not None else ttft
        if self.prompt_tokens and prompt_ms:
            prefill = self.prompt_tokens / (prompt_ms / 1000)
        if self._backend_count:
            mean = self._backend_total_ms / self._backend_count
            source = "backend"
        else:
            source = "client"
            mean = None
            if self.t_first is not None and self.t_last is not None and self.tokens > 1:
                mean = (self.t_last - self.t_first) * 1000 / (self.tokens - 1)
        total = (self.cache_n + self.prompt_tokens
                 if self.cache_n is not None and self.prompt_tokens is not None else None)
        return LatencySnapshot(self.tokens, ttft, prefill, mean, percentile(series, 50),
                               percentile(series, 95), source, series, self.cache_n, total,
                               self.prompt_ms)
