"""Chat message widgets: they render, the app's stream worker feeds them."""

from __future__ import annotations

import re
import time

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.timer import Timer
from textual.widgets import Collapsible, Static

from k3tui.textsafe import clean
from k3tui.tui.widgets.markdown import StreamedMarkdown

STATUS_TEXT = {
    "stopped": "■ stopped (Esc) — partial answer kept",
    "quit": "■ stopped when k3tui quit — partial answer kept",
    "interrupted": "■ interrupted — the backend or the TUI stopped mid-answer",
    "error": "✗ failed",
}

FLUSH_HZ = 10  # Markdown appends per second while streaming

FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)


def code_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced code blocks in `markdown`, in order."""
    return [m.group(2) for m in FENCE.finditer(markdown)]


class UserMessage(Static):
    def __init__(self, text: str, **kwargs) -> None:
        text = clean(text)  # a pasted prompt can carry escape sequences too
        super().__init__(text, markup=False, **kwargs)
        self.text = text
        self.queued = False   # sent while an answer ran: waiting for its turn
        self.border_title = "you"

    @property
    def body(self) -> str:
        """What Ctrl+Y copies."""
        return self.text

    def set_queued(self, queued: bool) -> None:
        self.queued = queued
        self.set_class(queued, "queued")
        self.set_picked("" if "picked" in self.classes else None)

    def set_picked(self, label: str | None) -> None:
        """Highlight (label: 'prompt 1 of 3') or not (None); the border says which."""
        self.set_class(label is not None, "picked")
        title = "you · queued" if self.queued else "you"
        if label is not None:
            keys = "esc takes it back" if self.queued else "ctrl+y copies"
            title = f"{title} · {label} · {keys}" if label else title
        self.border_title = title


class AssistantMessage(Vertical):
    """Reasoning (collapsible, collapsed once the answer starts), answer, status line."""

    def __init__(self, *, content: str = "", reasoning: str = "", status: str = "streaming",
                 note: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        # From the history: a row saved before text was cleaned on arrival may hold escapes.
        # Pieces, joined when read (about once a second): `str +=` per token copies the
        # whole answer each time, quadratic in its length.
        self._text = {"content": [clean(content)], "reasoning": [clean(reasoning)]}
        self.status = status
        self.note = clean(note)
        self.progress = ""   # a followed turn's pace (show_progress)
        self._pending: dict[str, list[str]] = {"reasoning": [], "content": []}
        self._last_flush = 0.0
        self._flush_timer: Timer | None = None

    def _joined(self, key: str) -> str:
        pieces = self._text[key]
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0]

    def _has(self, key: str) -> bool:
        pieces = self._text[key]
        return len(pieces) > 1 or bool(pieces[0])  # only non-empty pieces are appended

    @property
    def content(self) -> str:
        return self._joined("content")

    @property
    def reasoning(self) -> str:
        return self._joined("reasoning")

    @property
    def body(self) -> str:
        """What Ctrl+Y copies: the answer, never the reasoning."""
        return self.content

    def set_picked(self, label: str | None) -> None:
        """Highlight (label: 'answer 2 of 5') or not (None): a titled line on top."""
        self.set_class(label is not None, "picked")
        self.border_title = f"{label} · ctrl+y copies, ctrl+g its code" if label else ""

    def compose(self) -> ComposeResult:
        streaming = self.status == "streaming"
        collapsed = not streaming or bool(self.content)
        with Collapsible(title=self._reasoning_title(), collapsed=collapsed, classes="reasoning"):
            yield StreamedMarkdown(self.reasoning, classes="reasoning-md")
        yield StreamedMarkdown(self.content, classes="answer-md")
        yield Static("", classes="status-line", markup=False)  # notes quote the server

    def on_mount(self) -> None:
        self.query_one(".reasoning", Collapsible).display = bool(self.reasoning)
        self._show_status()

    def _reasoning_title(self) -> str:
        if self.status == "streaming" and not self.content:
            return "thinking…"
        return f"reasoning ({len(self.reasoning.split())} words) · ctrl+t"

    def _show_status(self) -> None:
        text = STATUS_TEXT.get(self.status, "")
        if self.note:
            text = f"{text} {self.note}".strip()
        elif self.status == "streaming":
            text = self.progress
        line = self.query_one(".status-line", Static)
        line.update(text)
        line.display = bool(text)

    @property
    def reasoning_block(self) -> Collapsible:
        return self.query_one(".reasoning", Collapsible)

    def show_waiting(self, text: str) -> None:
        """A status line under the empty answer while the server loads its model; the
        first token clears it."""
        self.note = clean(text)
        self._show_status()

    def show_progress(self, text: str) -> None:
        """A queued turn's pace while it streams (tokens, s/token, time left); its end
        replaces it with how it ended."""
        self.progress = text
        self._show_status()

    def _end_waiting(self) -> None:
        if self.note and not (self._has("content") or self._has("reasoning")):
            self.show_waiting("")

    async def add_reasoning(self, text: str) -> None:
        if not text:
            return
        self._end_waiting()
        self._text["reasoning"].append(text)
        block = self.reasoning_block
        if not block.display:
            block.display = True
        self._pending["reasoning"].append(text)
        await self._maybe_flush()

    async def add_content(self, text: str) -> None:
        if not text:
            return
        self._end_waiting()
        first = not self._has("content")
        self._text["content"].append(text)
        if first and self._has("reasoning"):
            block = self.reasoning_block
            block.collapsed = True
            block.title = self._reasoning_title()
        self._pending["content"].append(text)
        await self._maybe_flush()

    async def _maybe_flush(self) -> None:
        """Hand text to the Markdown at most FLUSH_HZ times a second: each append
        re-renders the live segment and re-lays out the chat, so 200 tok/s must not
        mean 200 renders a second."""
        now = time.monotonic()
        if now - self._last_flush >= 1 / FLUSH_HZ:
            await self.flush()
        elif self._flush_timer is None:
            self._flush_timer = self.set_timer(1 / FLUSH_HZ - (now - self._last_flush),
                                               self.flush)

    async def flush(self) -> None:
        self._last_flush = time.monotonic()
        if self._flush_timer is not None:
            self._flush_timer.stop()
            self._flush_timer = None
        for key, selector in (("reasoning", ".reasoning-md"), ("content", ".answer-md")):
            text, self._pending[key] = "".join(self._pending[key]), []
            if text:
                await self.query_one(selector, StreamedMarkdown).append(text)
        self._last_flush = time.monotonic()  # a slow flush still leaves 1/FLUSH_HZ to the rest

    async def finish(self, status: str, note: str = "") -> None:
        """Flush what is pending and stop the streams; the status line says how it ended."""
        self.status = status
        self.note = clean(note)
        await self.flush()
        if self.reasoning:
            self.reasoning_block.title = self._reasoning_title()
        self._show_status()

    def toggle_reasoning(self) -> None:
        if self.reasoning:
            self.reasoning_block.collapsed = not self.reasoning_block.collapsed
