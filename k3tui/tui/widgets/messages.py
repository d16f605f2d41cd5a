"""Chat message widgets: they render, the app's stream worker feeds them."""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets._markdown import MarkdownStream

STATUS_TEXT = {
    "stopped": "■ stopped (Esc) — partial answer kept",
    "interrupted": "■ interrupted — the backend or the TUI stopped mid-answer",
    "error": "✗ failed",
}

FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)


def code_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced code blocks in `markdown`, in order."""
    return [m.group(2) for m in FENCE.finditer(markdown)]


class UserMessage(Static):
    def __init__(self, text: str, **kwargs) -> None:
        super().__init__(text, markup=False, **kwargs)
        self.text = text
        self.border_title = "you"


class AssistantMessage(Vertical):
    """Reasoning (collapsible, collapsed once the answer starts), answer, status line."""

    def __init__(self, *, content: str = "", reasoning: str = "", status: str = "streaming",
                 note: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.content = content
        self.reasoning = reasoning
        self.status = status
        self.note = note
        self._content_stream: MarkdownStream | None = None
        self._reasoning_stream: MarkdownStream | None = None
        self.border_title = "assistant"

    def compose(self) -> ComposeResult:
        streaming = self.status == "streaming"
        with Collapsible(title=self._reasoning_title(), collapsed=not streaming or bool(self.content),
                         classes="reasoning"):
            yield Markdown(self.reasoning, classes="reasoning-md")
        yield Markdown(self.content, classes="answer-md")
        yield Static("", classes="status-line")

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
        line = self.query_one(".status-line", Static)
        line.update(text)
        line.display = bool(text)

    @property
    def reasoning_block(self) -> Collapsible:
        return self.query_one(".reasoning", Collapsible)

    async def add_reasoning(self, text: str) -> None:
        self.reasoning += text
        block = self.reasoning_block
        if not block.display:
            block.display = True
        if self._reasoning_stream is None:
            self._reasoning_stream = Markdown.get_stream(self.query_one(".reasoning-md", Markdown))
        await self._reasoning_stream.write(text)

    async def add_content(self, text: str) -> None:
        first = not self.content
        self.content += text
        if first and self.reasoning:
            block = self.reasoning_block
            block.collapsed = True
            block.title = self._reasoning_title()
        if self._content_stream is None:
            self._content_stream = Markdown.get_stream(self.query_one(".answer-md", Markdown))
        await self._content_stream.write(text)

    async def finish(self, status: str, note: str = "") -> None:
        """Stop the streams and re-render once in full (streamed fences can lose context)."""
        self.status = status
        self.note = note
        for stream in (self._reasoning_stream, self._content_stream):
            if stream is not None:
                await stream.stop()
        self._reasoning_stream = self._content_stream = None
        await self.query_one(".answer-md", Markdown).update(self.content)
        if self.reasoning:
            await self.query_one(".reasoning-md", Markdown).update(self.reasoning)
            self.reasoning_block.title = self._reasoning_title()
        self._show_status()

    def toggle_reasoning(self) -> None:
        if self.reasoning:
            self.reasoning_block.collapsed = not self.reasoning_block.collapsed
