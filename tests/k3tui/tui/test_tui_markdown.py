"""Streamed Markdown: the work per append is bounded however long the answer gets.

A model in a repetition loop writes thousands of lines without a blank one (or one huge
paragraph, or one huge code fence); the live segment then never sealed, so every flush
parsed the whole answer again and 10,000 lines took minutes to reach the screen. These
tests count the characters handed to the Markdown parser, never the time.
"""

from __future__ import annotations

import random

import pytest
from markdown_it import MarkdownIt
from rich.console import Console
from rich.markdown import Markdown
from textual.app import App, ComposeResult

from k3tui.tui.bench import script_tokens
from k3tui.tui.widgets.markdown import (
    MAX_CHARS,
    MarkdownSegment,
    StreamedMarkdown,
    _SegmentMarkdown,
    split_segments,
)

SHAPES = {
    "lines": "".join(f"line {i}: the model repeats itself again\n" for i in range(1500)),
    "paragraph": "".join(f"word{i} again and again " for i in range(3000)),
    "fence": "Intro.\n\n```python\n" + "".join(f"x_{i} = step({i})  # again\n"
                                             for i in range(1500)),
    "list": "".join(f"- item {i} of the same list\n" for i in range(1500)),
    "blob": "x" * 30_000,
}


class Holder(App):
    def compose(self) -> ComposeResult:
        yield StreamedMarkdown()


@pytest.fixture
def parsed(monkeypatch) -> list[int]:
    """The length of every text the Markdown parser is given, in order."""
    sizes: list[int] = []
    real = MarkdownIt.parse

    def counting(self, src, env=None):
        sizes.append(len(src))
        return real(self, src, env)

    monkeypatch.setattr(MarkdownIt, "parse", counting)
    return sizes


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_each_append_parses_a_bounded_amount_however_long_the_answer(shape, parsed):
    text = SHAPES[shape]
    chunk = 600  # one flush's worth at a fast stream
    async with Holder().run_test() as pilot:
        md = pilot.app.query_one(StreamedMarkdown)
        await pilot.pause()
        per_append = []
        for i in range(0, len(text), chunk):
            parsed.clear()
            await md.append(text[i:i + chunk])
            per_append.append(sum(parsed))
        await pilot.pause()
        assert md.source == text
        segments = list(md.query(MarkdownSegment))
    # The live segment never holds more than MAX_CHARS (+ the fence line it reopens), so
    # an append re-parses at most that and the new text: flat, not growing with the answer.
    assert max(per_append) <= MAX_CHARS + 2 * chunk, per_append
    assert sum(per_append) <= 10 * len(text)
    assert all(len(s.source) <= MAX_CHARS for s in segments)
    assert "".join(s.source for s in segments) == text


@pytest.mark.parametrize("shape", sorted(SHAPES) + ["bench"])
def test_an_answer_streamed_in_any_pieces_is_cut_like_the_stored_one(shape):
    text = SHAPES.get(shape) or "".join(script_tokens(3000))
    whole = split_segments(text)
    assert "".join(p.text for p in whole) == text
    for seed, sizes in enumerate(([3, 1, 7, 60], [500, 9000])):
        rng = random.Random(seed)
        parts, at = [split_segments("")[0]], 0
        while at < len(text):
            n = rng.choice(sizes)
            live = parts.pop()
            parts += split_segments(live.text + text[at:at + n], live.fence)
            at += n
        assert parts == whole, (shape, sizes)


def test_a_fence_cut_into_segments_renders_as_one_code_block():
    """The next segment reopens the fence with its own opening line; the padding rows at
    the seams go, so the pieces render exactly like the whole block."""
    text = ("Intro.\n\n```python\n" + "".join(f"x_{i} = step({i})\n" for i in range(400))
            + "```\n\nAfter.\n")
    parts = split_segments(text)
    assert len(parts) >= 4 and parts[1].fence == "```python\n"
    console = Console(width=60, color_system=None)

    def lines(renderables) -> list[str]:
        with console.capture() as capture:
            for r in renderables:
                console.print(r)
        return capture.get().splitlines()

    pieces = [_SegmentMarkdown(p.fence + p.text, joins_above=bool(p.fence),
                               joins_below=bool(after.fence))
              for p, after in zip(parts, [*parts[1:], split_segments("")[0]])]
    assert lines(pieces) == lines([Markdown(text)])
