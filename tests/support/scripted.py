"""A scripted stream that yields the same events as the real client, for tests and screenshots.

The clock is fake: each token advances it by its scripted gap, so latency figures and
sparklines come out identical on every run.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any

from k3tui.backends.events import (
    BackendError,
    ContentDelta,
    Finished,
    ReasoningDelta,
    StreamEvent,
    TokenStats,
)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def split_tokens(text: str) -> list[str]:
    """Word-ish pieces, keeping whitespace and newlines, like a real tokenizer's deltas."""
    return re.findall(r"\s*\S+|\s+", text)


class ScriptedStream:
    """Callable with the app's stream signature: `stream(messages) -> AsyncIterator`.

    `hang_after` stops producing after that many content tokens until cancelled (Esc tests);
    `error` ends with a BackendError instead of Finished.
    """

    def __init__(self, content: str, reasoning: str = "", *, clock: FakeClock | None = None,
                 gaps_ms: Iterable[float] | None = None, ttft_ms: float = 250.0,
                 k3: dict[str, Any] | None = None, hang_after: int | None = None,
                 error: BackendError | None = None, real_delay_s: float = 0.0,
                 backend_timings: bool = False, prompt_tokens: int = 12) -> None:
        self.content = content
        self.reasoning = reasoning
        self.clock = clock or FakeClock()
        self.gaps = list(gaps_ms or [])
        self.ttft_ms = ttft_ms
        self.k3 = k3 or {}
        self.hang_after = hang_after
        self.error = error
        self.real_delay_s = real_delay_s
        self.backend_timings = backend_timings
        self.prompt_tokens = prompt_tokens
        self.requests: list[list[dict[str, Any]]] = []
        self.closed = 0

    def __call__(self, messages: list[dict[str, Any]]) -> AsyncIterator[StreamEvent]:
        self.requests.append([dict(m) for m in messages])
        return self._run()

    async def _run(self) -> AsyncIterator[StreamEvent]:
        pieces = [(ReasoningDelta, p) for p in split_tokens(self.reasoning)]
        pieces += [(ContentDelta, p) for p in split_tokens(self.content)]
        self.clock.advance(self.ttft_ms / 1000)
        content_count = 0
        try:
            for i, (kind, text) in enumerate(pieces):
                if i:
                    gap = self.gaps[i % len(self.gaps)] if self.gaps else 40.0
                    self.clock.advance(gap / 1000)
                else:
                    gap = None
                if self.real_delay_s:
                    await asyncio.sleep(self.real_delay_s)
                else:
                    await asyncio.sleep(0)
                yield kind(text)
                backend_ms = gap if (self.backend_timings and gap is not None) else None
                yield TokenStats(arrival_s=self.clock(), tokens=1, backend_ms=backend_ms,
                                 prompt_tokens=self.prompt_tokens if i == 0 else None,
                                 prompt_ms=self.ttft_ms if i == 0 else None,
                                 k3=dict(self.k3))
                if kind is ContentDelta:
                    content_count += 1
                    if self.hang_after is not None and content_count >= self.hang_after:
                        await asyncio.Event().wait()
            if self.error is not None:
                yield self.error
                return
            yield Finished("stop", usage={"prompt_tokens": self.prompt_tokens,
                                          "completion_tokens": len(pieces)})
        finally:
            self.closed += 1


class FixedMonitor:
    """A Monitor stand-in that returns a scripted series of samples (snapshots, screenshots)."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples
        self.i = 0
        self.pid: int | None = None

    def set_pid(self, pid: int | None) -> None:
        self.pid = pid

    def sample(self) -> Any:
        s = self.samples[min(self.i, len(self.samples) - 1)]
        self.i += 1
        return s
