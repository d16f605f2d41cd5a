"""A turn in the store as a stream of events, for a chat that shows it live.

The chat renders any answer from the same typed events (k3tui/backends/events.py); a
queued turn is answered by its runner, not by the chat, so the chat reads it back from the
store: the text and tokens that came since the last look, then how it ended. Any number of
chats can follow one turn; none of them holds its stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from k3tui.answers.store import TurnStore
from k3tui.backends.events import (
    BackendError,
    ContentDelta,
    Finished,
    ReasoningDelta,
    StreamEvent,
    TokenStats,
    TurnProgress,
    Waiting,
)

POLL_S = 0.2


async def follow_turn(store: TurnStore, turn_id: int, *, poll_s: float = POLL_S,
                      clock: Callable[[], float] = time.monotonic
                      ) -> AsyncIterator[StreamEvent]:
    """Everything the turn has (from its start), then what comes, until it ends."""
    reasoning = content = tokens = 0
    said_queued = False
    while True:
        t = store.get(turn_id)
        if len(t.reasoning) > reasoning:
            yield ReasoningDelta(t.reasoning[reasoning:])
            reasoning = len(t.reasoning)
        if len(t.content) > content:
            yield ContentDelta(t.content[content:])
            content = len(t.content)
        if t.tokens > tokens:
            yield TokenStats(arrival_s=clock(), tokens=t.tokens - tokens)
            tokens = t.tokens
            limit = t.settings.get("max_tokens")
            yield TurnProgress(t.tokens, t.s_per_token, t.eta_s,
                               limit if type(limit) is int else None)
        if t.state == "queued" and not said_queued:
            said_queued = True
            yield Waiting("queued behind the answers before it (`k3tui answers`)")
        if t.state == "done":
            reason, _, note = t.stop_reason.partition(": ")
            yield Finished(reason or "stop", note=note)
            return
        if t.state == "failed":
            yield BackendError(t.stop_reason or "The answer failed.",
                               t.next_step or f"see `k3tui answers show {t.id}`", retry=True)
            return
        if t.state == "stopped":
            yield Finished("stop", note=t.stop_reason)
            return
        await asyncio.sleep(poll_s)
