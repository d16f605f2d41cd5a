"""Streamed Markdown that stays cheap however long the chat gets.

Textual's Markdown widget mounts a widget per block (a list item is three), and every
append re-lays out the whole chat, so a long conversation makes each token slower. Here
an answer is a few `Static`s, each rendering Rich Markdown: while streaming only the last
segment re-renders; once it grows past SEAL_CHARS it is sealed at a blank line outside
any code fence and a new segment starts. A fence being streamed is therefore always
rendered whole (an unclosed fence renders as code up to the end, as it should).
"""

from __future__ import annotations

from rich.markdown import Markdown as RichMarkdown
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from k3tui.textsafe import clean

SEAL_CHARS = 1200  # ~200 tokens: re-rendering this much per flush is cheap


def cut_points(text: str) -> list[int]:
    """Offsets where `text` can be cut into two Markdown documents that render like the
    whole: after a blank line, outside a fence, before a line that does not start with
    whitespace (which could continue a list item or be an indented code block)."""
    fence = ""
    points = []
    offset = 0
    lines = text.split("\n")
    for i, line in enumerate(lines[:-1]):
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = ""
        elif stripped.startswith("```") or stripped.startswith("~~~"):
            fence = stripped[:3]
        offset += len(line) + 1
        following = lines[i + 1]
        if (not fence and not line.strip() and following[:1] not in ("", " ", "\t")
                and i + 1 < len(lines) - 1):  # the next line is complete
            points.append(offset)
    return points


def split_segments(text: str, min_chars: int = SEAL_CHARS) -> list[str]:
    """A stored answer cut into segments of at least `min_chars` (the last may be shorter)."""
    parts, start = [], 0
    for point in cut_points(text):
        if point - start >= min_chars:
            parts.append(text[start:point])
            start = point
    parts.append(text[start:])
    return parts


class MarkdownSegment(Static):
    DEFAULT_CSS = "MarkdownSegment { height: auto; }"

    def __init__(self, source: str = "", **kwargs) -> None:
        super().__init__("", **kwargs)
        self.source = source

    def on_mount(self) -> None:
        self.set_source(self.source, force=True)

    def set_source(self, source: str, force: bool = False) -> None:
        if source == self.source and not force:
            return
        self.source = source
        dark = getattr(self.app, "current_theme", None)
        code_theme = "monokai" if dark is None or dark.dark else "friendly"
        # Rich Markdown would pass escape sequences through to the terminal.
        self.update(RichMarkdown(clean(source), code_theme=code_theme, hyperlinks=True))


class StreamedMarkdown(Vertical):
    """`append(text)` adds to the last segment; older segments never re-render."""

    DEFAULT_CSS = "StreamedMarkdown { height: auto; }"

    def __init__(self, source: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.source = source
        self._parts = split_segments(source)

    def compose(self) -> ComposeResult:
        for part in self._parts:
            yield MarkdownSegment(part)

    async def append(self, text: str) -> None:
        if not text:
            return
        self.source += text
        live = self._parts[-1] + text
        parts = split_segments(live)
        self._parts[-1:] = parts
        segments = list(self.query(MarkdownSegment))
        segments[-1].set_source(parts[0])
        if len(parts) > 1:
            await self.mount_all([MarkdownSegment(part) for part in parts[1:]])
