"""A text sparkline that keeps spikes (max per bucket), with an ASCII fallback."""

from __future__ import annotations

import os
import sys

from rich.text import Text
from textual.widgets import Static

BLOCKS = " ▁▂▃▄▅▆▇█"
ASCII = " _.-:=+*#"


def terminal_is_ascii() -> bool:
    """True when the terminal probably cannot draw block characters."""
    if os.environ.get("K3TUI_ASCII"):
        return os.environ["K3TUI_ASCII"] not in ("0", "")
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower()
    lang = " ".join(os.environ.get(k, "") for k in ("LC_ALL", "LC_CTYPE", "LANG")).lower()
    return os.environ.get("TERM") == "linux" or ("utf" not in encoding and "utf" not in lang)


def bucket_max(values: list[float], width: int) -> list[float]:
    """Squash `values` into at most `width` columns, each the max of its bucket."""
    if width <= 0:
        return []
    if len(values) <= width:
        return list(values)
    out = []
    n = len(values)
    for i in range(width):
        lo, hi = i * n // width, (i + 1) * n // width
        out.append(max(values[lo:max(hi, lo + 1)]))
    return out


def render_sparkline(values: list[float], width: int, *, ascii: bool = False,
                     floor: float = 0.0) -> str:
    """One line of `width` characters; empty columns are spaces (right-aligned data)."""
    glyphs = ASCII if ascii else BLOCKS
    cols = bucket_max(values, width)
    if not cols:
        return " " * width
    top = max(max(cols), floor, 1e-12)
    levels = len(glyphs) - 1
    chars = []
    for v in cols:
        level = 0 if v <= 0 else max(1, min(levels, round(v / top * levels)))
        chars.append(glyphs[level])
    return " " * (width - len(chars)) + "".join(chars)


class Sparkline(Static):
    """Static that renders `values` to its own width on refresh."""

    DEFAULT_CSS = "Sparkline { height: 1; }"

    def __init__(self, *, ascii: bool = False, style: str = "", floor: float = 0.0,
                 **kwargs) -> None:
        super().__init__("", **kwargs)
        self.ascii = ascii
        self.floor = floor
        self.values: list[float] = []
        self._line_style = style
        self._drawn: str | None = None  # the line last rendered

    def set_values(self, values: list[float]) -> None:
        self.values = list(values)
        # Repaint only when the drawn line changes (an idle disk appends zeros forever).
        if self._line() != self._drawn:
            self.refresh()  # no layout: the height is always one line

    def _line(self) -> str:
        return render_sparkline(self.values, self.size.width, ascii=self.ascii, floor=self.floor)

    def render(self) -> Text:
        self._drawn = self._line()
        return Text(self._drawn, style=self._line_style, no_wrap=True, overflow="crop")
