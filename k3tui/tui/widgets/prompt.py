"""The prompt: Enter sends, Ctrl+J inserts a newline, Up/Down recall earlier prompts."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class Prompt(TextArea):
    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, history: list[str] | None = None, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=True, **kwargs)
        # A blinking cursor repaints twice a second forever: half the idle CPU budget.
        self.cursor_blink = False
        self.recall: list[str] = list(history or [])
        self._recall_at: int | None = None   # index into history while browsing
        self._draft = ""

    def remember(self, text: str) -> None:
        if text and (not self.recall or self.recall[-1] != text):
            self.recall.append(text)
        self._recall_at = None

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self.recall:
            event.stop()
            event.prevent_default()
            if self._recall_at is None:
                self._draft = self.text
                self._recall_at = len(self.recall)
            self._recall_at = max(0, self._recall_at - 1)
            self._show(self.recall[self._recall_at])
            return
        if (event.key == "down" and self._recall_at is not None
                and self.cursor_location[0] == self.document.line_count - 1):
            event.stop()
            event.prevent_default()
            self._recall_at += 1
            if self._recall_at >= len(self.recall):
                self._recall_at = None
                self._show(self._draft)
            else:
                self._show(self.recall[self._recall_at])
            return
        await super()._on_key(event)

    def _show(self, text: str) -> None:
        self.text = text
        self.move_cursor(self.document.end)
