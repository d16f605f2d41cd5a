"""Typed events a streaming chat completion turns into.

Every backend (bundled engine, llama-server, remote endpoint) is read through the same
OpenAI-compatible SSE client, which yields these. The TUI only renders them. Their text
is the backend's, so each event cleans it on construction (`k3tui.textsafe`): nothing a
server wrote reaches the terminal, the history or an export with its escape sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3tui.textsafe import clean


def _clean_fields(event: object, *names: str) -> None:
    for name in names:
        object.__setattr__(event, name, clean(getattr(event, name)))


@dataclass(frozen=True)
class ReasoningDelta:
    text: str

    def __post_init__(self) -> None:
        _clean_fields(self, "text")


@dataclass(frozen=True)
class ContentDelta:
    text: str

    def __post_init__(self) -> None:
        _clean_fields(self, "text")


@dataclass(frozen=True)
class TokenStats:
    """Per-token figures. `arrival_s` is the client's monotonic clock at receipt.

    `backend_ms` is the backend's own per-token time when it reports one (llama-server
    `timings`, the engine's `k3.s_per_token`); `k3` holds the engine's I/O counters
    (gb_read, mb_per_s, true_hit_rate, rss_gb, budget_gb, ...) when the backend is ours.
    """

    arrival_s: float
    tokens: int
    backend_ms: float | None = None
    prompt_ms: float | None = None
    prompt_tokens: int | None = None
    k3: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenIds:
    """The ids a chunk carried (the engine's `k3.token_ids`: every id since the chunk
    before, hidden tags included). Kept with the reply, they let a later request send it
    back exactly (`k3_token_ids`) and continue a cut answer where it stopped."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    finish_reason: str | None
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # e.g. why the content is empty after finish_reason "length"

    def __post_init__(self) -> None:
        _clean_fields(self, "note")


@dataclass(frozen=True)
class BackendError:
    message: str
    next_step: str = ""
    log_tail: str = ""
    # whether sending the same request again can succeed (a conversation over the
    # context size, or a wrong API key, fails the same way until the user changes it)
    retry: bool = True

    def __post_init__(self) -> None:
        _clean_fields(self, "message", "next_step", "log_tail")


@dataclass(frozen=True)
class Waiting:
    """The server is up but still loading the model: the prompt is sent once it is ready."""

    message: str

    def __post_init__(self) -> None:
        _clean_fields(self, "message")


@dataclass(frozen=True)
class TurnProgress:
    """A queued turn's pace as its runner stored it (k3tui/answers): tokens so far, seconds
    per token and the time left to `max_tokens` at that pace (None until known)."""

    tokens: int
    s_per_token: float | None
    eta_s: float | None
    max_tokens: int | None


StreamEvent = (ReasoningDelta | ContentDelta | TokenStats | TokenIds | Finished | BackendError
               | Waiting | TurnProgress)
