"""Streamed Markdown whose cost per token is bounded however long the answer gets.

Textual's Markdown widget mounts a widget per block (a list item is three), and every
append re-lays out the whole chat, so a long conversation makes each token slower. Here
an answer is a few `Static`s, each rendering Rich Markdown: while streaming only the last
segment re-renders, and it never holds more than MAX_CHARS, so each flush parses at most
that much. A segment is sealed at the first clean cut past SEAL_CHARS: after a blank line
outside any code fence, where the two halves render like the whole, or at a line break
inside a fence: the next segment repeats the fence's opening line and the two code blocks
join without a padding row. Text with no such cut (thousands of lines without a blank
one, one huge paragraph: a model in a repetition loop writes exactly this) is cut anyway
at MAX_CHARS, at the last line break, else the last space.

The cuts depend only on the text before them, so an answer streamed in any pieces is
split exactly like the same answer loaded from the history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.markdown import CodeBlock
from rich.markdown import Markdown as RichMarkdown
from rich.syntax import Syntax
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from k3tui.textsafe import clean

SEAL_CHARS = 1200  # ~200 tokens: re-rendering this much per flush is cheap
MAX_CHARS = 4000   # a live segment is cut here even where no clean cut came


@dataclass(frozen=True)
class Part:
    """A segment: `text`, the answer's own characters, inside the fence opened by the line
    `fence` (e.g. "```python\\n") when it continues one, else outside any."""

    text: str
    fence: str = ""


def _cut(text: str, start: int, fence: str, min_chars: int,
         max_chars: int) -> tuple[int, str] | None:
    """Where the segment starting at `start` (inside `fence`) ends, and the fence the next
    one starts inside; None while the text so far cannot tell. Reads at most max_chars."""
    marker = fence.lstrip()[:3]
    limit = start + max_chars
    pos, last_line, last_clean = start, None, None
    while (newline := text.find("\n", pos, limit)) != -1:
        line = text[pos:newline]
        stripped = line.lstrip()
        opened = False
        if marker:
            if stripped.startswith(marker):
                fence = marker = ""
        elif stripped.startswith(("```", "~~~")):
            fence, marker, opened = line + "\n", stripped[:3], True
        pos = newline + 1
        if pos == len(text):
            return None  # the next line decides: not here yet
        if not marker:
            # Clean: after a blank line, before a line that does not start with whitespace
            # (which could continue a list item or be an indented code block).
            if not line.strip() and text[pos] not in " \t\n":
                if pos - start >= min_chars:
                    return pos, ""
                last_clean = pos
        elif not opened and pos - start >= min_chars:
            # In a fence every line break is as good: the next segment reopens the fence
            # and the code joins. Not before the closing line (it would be an empty block).
            following = text.find("\n", pos, limit)
            if following == -1:
                return None if len(text) <= limit else (pos, fence)
            if not text[pos:following].lstrip().startswith(marker):
                return pos, fence
        last_line = (pos, fence)
    if len(text) <= limit:
        return None
    if last_clean is not None:
        return last_clean, ""
    if last_line is not None:
        return last_line
    space = text.rfind(" ", start + 1, limit)
    return (space + 1 if space != -1 else limit), fence


def split_segments(text: str, fence: str = "", min_chars: int = SEAL_CHARS,
                   max_chars: int = MAX_CHARS) -> list[Part]:
    """`text` (starting inside `fence`) cut into segments: each but the last is final."""
    parts, start = [], 0
    while (cut := _cut(text, start, fence, min_chars, max_chars)) is not None:
        end, next_fence = cut
        parts.append(Part(text[start:end], fence))
        start, fence = end, next_fence
    parts.append(Part(text[start:], fence))
    return parts


class _JoinedCodeBlock(CodeBlock):
    """Rich's code block, without its padding row on a side where the fence runs on into
    the segment above or below."""

    @classmethod
    def create(cls, markdown: Any, token: Any) -> CodeBlock:
        block = super().create(markdown, token)
        top = 0 if markdown.joins_above and token is markdown.parsed[0] else 1
        bottom = 0 if markdown.joins_below and token is markdown.parsed[-1] else 1
        block.padding = (top, 1, bottom, 1)
        return block

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield Syntax(str(self.text).rstrip(), self.lexer_name, theme=self.theme,
                     word_wrap=True, padding=self.padding)


class _SegmentMarkdown(RichMarkdown):
    elements = {**RichMarkdown.elements, "fence": _JoinedCodeBlock}

    def __init__(self, markup: str, *, joins_above: bool, joins_below: bool,
                 **kwargs: Any) -> None:
        self.joins_above, self.joins_below = joins_above, joins_below
        super().__init__(markup, **kwargs)


class MarkdownSegment(Static):
    DEFAULT_CSS = "MarkdownSegment { height: auto; }"

    def __init__(self, part: Part | None = None, joins_below: bool = False, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.part = part or Part("")
        self.joins_below = joins_below

    @property
    def source(self) -> str:
        """The answer's text this segment shows."""
        return self.part.text

    def on_mount(self) -> None:
        self.set_part(self.part, self.joins_below, force=True)

    def set_part(self, part: Part, joins_below: bool = False, force: bool = False) -> None:
        if (part, joins_below) == (self.part, self.joins_below) and not force:
            return
        self.part, self.joins_below = part, joins_below
        dark = getattr(self.app, "current_theme", None)
        code_theme = "monokai" if dark is None or dark.dark else "friendly"
        # Rich Markdown would pass escape sequences through to the terminal.
        self.update(_SegmentMarkdown(clean(part.fence + part.text), code_theme=code_theme,
                                     hyperlinks=True, joins_above=bool(part.fence),
                                     joins_below=joins_below))


def _segments(parts: list[Part]) -> list[MarkdownSegment]:
    return [MarkdownSegment(part, joins_below=bool(after.fence))
            for part, after in zip(parts, [*parts[1:], Part("")])]


class StreamedMarkdown(Vertical):
    """`append(text)` adds to the last segment; older segments never re-render."""

    DEFAULT_CSS = "StreamedMarkdown { height: auto; }"

    def __init__(self, source: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self._initial = split_segments(source)
        self._texts = [p.text for p in self._initial]  # each segment's (joined when asked)
        self._live = self._initial[-1]

    @property
    def source(self) -> str:
        return "".join(self._texts)

    def compose(self) -> ComposeResult:
        parts, self._initial = self._initial, []
        yield from _segments(parts)

    async def append(self, text: str) -> None:
        if not text:
            return
        parts = split_segments(self._live.text + text, self._live.fence)
        self._live = parts[-1]
        self._texts[-1:] = [p.text for p in parts]
        new = _segments(parts)
        self.children[-1].set_part(new[0].part, new[0].joins_below)  # type: ignore[attr-defined]
        if len(new) > 1:
            await self.mount_all(new[1:])
