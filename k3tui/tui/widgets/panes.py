"""Latency and I/O panes. They only render; the app feeds them at most 4 times a second."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from k3tui.monitor import Sample
from k3tui.tui.stats import LatencySnapshot, format_ms, format_rate
from k3tui.units import gb_amount
from k3tui.tui.widgets.sparkline import Sparkline


def _set_text(widget: Static, lines: list[str]) -> None:
    """Update only on change, and without a layout pass: the text's height is fixed in CSS,
    and a layout of a long chat is what costs CPU, several times a second when idle."""
    text = "\n".join(lines)
    shown = widget.content
    if not (isinstance(shown, Text) and shown.plain == text):
        widget.update(Text(text, no_wrap=True, overflow="ellipsis"), layout=False)


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{unit}"


class LatencyPane(Vertical):
    """Sparkline of per-token ms (max per column keeps spikes) plus the figures as text."""

    def __init__(self, *, ascii: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "latency"
        self._ascii = ascii

    def compose(self) -> ComposeResult:
        yield Sparkline(ascii=self._ascii, id="lat-spark")
        yield Static("", id="lat-text")

    def show(self, snap: LatencySnapshot) -> None:
        self.query_one("#lat-spark", Sparkline).set_values(snap.series)
        title = f"latency ({snap.source} timing)" if snap.tokens else "latency"
        if self.border_title != title:
            self.border_title = title
        rate = format_rate(snap.gen_ms_per_token)
        lines = [
            f"TTFT {format_ms(snap.ttft_ms):<9} gen {rate}",
            f"p50  {format_ms(snap.p50_ms):<9} p95 {format_ms(snap.p95_ms)}",
            f"prefill {_num(snap.prefill_tok_s, '.0f', ' tok/s'):<10} {snap.tokens} tokens",
        ]
        if snap.reused is not None and snap.prompt_total is not None:
            lines.append(f"reused {snap.reused} of {snap.prompt_total} prompt tokens, "
                         f"prefill {format_ms(snap.prompt_ms)}")
        _set_text(self.query_one("#lat-text", Static), lines)


def memory_title(kind: str, reported_budget: float | None, budget_gb: float | None) -> str:
    """The I/O pane's title says what bounds the backend's memory, so "RSS" is read right:
    the engine's budget caps its weights (RSS adds a fixed few hundred MB and more), a
    llama-server limit caps the whole process, a remote server's memory is not visible."""
    budget = reported_budget or budget_gb
    if kind == "remote":
        return "I/O · remote: RSS not visible"
    if kind == "llama-server":
        return f"I/O · RSS limit {gb_amount(budget)}" if budget else "I/O · no memory limit"
    if budget:
        return f"I/O · streaming, weights ≤{gb_amount(budget)}"
    if reported_budget == 0:           # the engine says so: no budget, every weight resident
        return "I/O · weights resident"
    return "I/O"


def pool_line(pool: tuple[tuple[str, bool, int | None], ...]) -> str:
    """A pool head's memory line, where a local backend shows its RSS: how many workers
    the head is connected to and what the load put on each, in the config's order."""
    largest = max((b for _, up, b in pool if up and b is not None), default=0)
    size, unit = (1e9, "GB") if largest >= 1e9 else (1e6, "MB")
    digits = 1 if largest < 10 * size else 0  # one unit for all: the figures line up
    each = "·".join(f"{b / size:.{digits}f}" if up and b is not None else
                    ("up" if up else "down") for _, up, b in pool)
    return f"pool {sum(up for _, up, _ in pool)}/{len(pool)} up: {each} {unit}"


class IOPane(Vertical):
    """Disk and memory: system and backend read MB/s, GB/token, hit rate, RSS vs budget."""

    def __init__(self, *, ascii: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "I/O"
        self._ascii = ascii
        self.disk_series: list[float] = []

    def compose(self) -> ComposeResult:
        # A floor keeps a few MB/s of noise from looking like a wall of reads.
        yield Sparkline(ascii=self._ascii, floor=50.0, id="io-spark")
        yield Static("", id="io-text")

    def show(self, sample: Sample | None, k3: dict[str, Any] | None,
             budget_gb: float | None = None, kind: str = "") -> None:
        k3 = k3 or {}
        if sample is not None and sample.disk_read_mb_s is not None:
            self.disk_series = (self.disk_series + [sample.disk_read_mb_s])[-240:]
        self.query_one("#io-spark", Sparkline).set_values(self.disk_series)
        s = sample or Sample(t=0.0)
        title = memory_title(kind, k3.get("budget_gb"), budget_gb)
        if title != self.border_title:
            self.border_title = title
        rss = s.proc_rss_gb if s.proc_rss_gb is not None else k3.get("rss_gb")
        # A remote server's process is not ours to see: the title says so, the line agrees.
        rss_text = "not visible" if kind == "remote" else gb_amount(rss)
        # Machine-wide figures at 0.1 GB: finer digits flicker with every other process
        # and would repaint the pane at each sample for nothing.
        cg = _num(s.cgroup_current_gb, ".1f", " GB")
        if s.cgroup_current_gb is not None:
            cg += f" / {s.cgroup_max_gb:.1f} GB" if s.cgroup_max_gb else " (no max)"
        hit = k3.get("true_hit_rate")
        # The engine counts its own reads (page-cache hits included); the kernel's
        # per-process counter only sees storage, so prefer the engine's when it reports.
        # One label either way: the source changing must not rename the figure.
        mb_s = k3["mb_per_s"] if k3.get("mb_per_s") is not None else s.proc_read_mb_s
        proc = f"backend {_num(mb_s, '.0f', ' MB/s')}"
        lines = [
            f"disk {_num(s.disk_read_mb_s, '.0f', ' MB/s')}  {proc}",
            f"read/token {gb_amount(k3.get('gb_read'))}  "
            f"hit {_num(None if hit is None else hit * 100, '.0f', '%')}",
            pool_line(s.pool) if s.pool else
            f"RSS {rss_text}  cache {_num(s.page_cache_gb, '.1f', ' GB')}",
            f"PSI {_num(s.psi_some_avg10, '.1f')}/{_num(s.psi_full_avg10, '.1f')}  cg {cg}",
        ]
        _set_text(self.query_one("#io-text", Static), lines)
