"""Routes one answer's stream events (matched in `session.ChatSession.consume`) to the
widgets: the answer's text and reasoning, the latency stats, the header's budget, notices."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k3tui.backends.events import Finished, TokenStats, TurnProgress
from k3tui.planning.forecast import duration, per_token
from k3tui.tui.widgets.messages import AssistantMessage

if TYPE_CHECKING:
    from k3tui.tui.app import ChatScreen


class AnswerHandler:
    """The `AnswerView` of one answer on the chat screen."""

    def __init__(self, screen: ChatScreen, widget: AssistantMessage) -> None:
        self.screen = screen
        self.widget = widget

    @property
    def content(self) -> str:
        return self.widget.content

    @property
    def reasoning(self) -> str:
        return self.widget.reasoning

    async def add_content(self, text: str) -> None:
        await self.widget.add_content(text)

    async def add_reasoning(self, text: str) -> None:
        await self.widget.add_reasoning(text)

    def token(self, ev: TokenStats) -> None:
        self.screen.stats.on_token(ev)
        if ev.k3:
            self.screen.k3 = ev.k3
            self.screen.learn_budget(ev.k3.get("budget_gb"))

    def finished(self, ev: Finished) -> None:
        self.screen.stats.on_finished(ev)

    def waiting(self, message: str) -> None:
        self.widget.show_waiting(message)

    def progress(self, ev: TurnProgress) -> None:
        self.widget.show_progress(progress_line(ev))

    def failed(self, message: str, next_step: str, retry: bool) -> None:
        self.screen.backend_failed(message, next_step, retry)

    def turn_meta(self) -> dict[str, Any]:
        return self.screen.turn_meta()

    def cancelled_status(self) -> str:
        """Only Esc and the app's exit cancel an answer; say which one it was."""
        return "stopped" if self.screen.esc_stopped else "quit"

    async def done(self, status: str, note: str) -> None:
        await self.widget.finish(status, note)
        if status in ("done", "error") and not self.screen.esc_stopped:
            self.screen.tell_finished(status)
        self.screen.refresh_panes(force=True)
        self.screen.answer_done()


def progress_line(ev: TurnProgress) -> str:
    """The running answer's status line: what has come and what is left, in time one can
    plan with ('120 tokens · 8.7 s/token · ~2.1 h more to max_tokens 1,000')."""
    parts = [f"{ev.tokens:,} token{'s' if ev.tokens != 1 else ''}"]
    if ev.s_per_token is not None:
        parts.append(f"{per_token(ev.s_per_token)} s/token")
    if ev.eta_s is not None and ev.max_tokens is not None:
        parts.append(f"at most {duration(ev.eta_s)} more (max_tokens {ev.max_tokens:,})")
    return " · ".join(parts)
