"""Downloads and packing: attach to detached jobs by reading their state files.

The jobs run in their own processes (DL's `k3tui.jobs`); this screen only reads the JSON
state (keys in the interfaces brief) twice a second, so closing it never stops a job.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, ProgressBar, Static

from k3tui import jobs
from k3tui.hub.progress import file_counts
from k3tui.textsafe import clean
from k3tui.units import GB, MB

def read_jobs(kind: str) -> list[dict[str, Any]]:
    """All job states of `kind`, newest first (a damaged state file is skipped)."""
    return [s for s in jobs.list_jobs() if s.get("kind") == kind]


def format_eta(seconds: float | None) -> str:
    """Capped like `ollama pull`: nobody plans around "412h"."""
    if seconds is None or seconds < 0:
        return "–"
    if seconds >= 99 * 3600:
        return "99h+"
    h, rem = divmod(int(seconds), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def overall_line(state: dict[str, Any]) -> Text:
    done = (state.get("done_bytes") or 0) / GB
    total = (state.get("total_bytes") or 0) / GB
    rate = (state.get("rate_bps") or 0) / MB
    status = clean(str(state.get("status", "?")))
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"{status:<9}", style="bold")
    text.append(f"{done:,.1f} / {total:,.1f} GB  ")
    if state.get("stalled"):
        text.append("stalled", style="bold red")
    elif status == "running":
        text.append(f"{rate:,.1f} MB/s  ETA {format_eta(state.get('eta_s'))}")
    if state.get("layer") is not None:
        text.append(f"  layer {state['layer']}")
    return text


class JobsScreen(Screen):
    """`kind` is "download" or "pack"."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("q", "app.pop_screen", "Back")]

    def __init__(self, kind: str, refresh_hz: float = 2.0) -> None:
        super().__init__()
        self.kind = kind
        self.refresh_hz = refresh_hz

    def compose(self) -> ComposeResult:
        title = "downloads" if self.kind == "download" else "packing"
        with Vertical(id="jobs"):
            yield Static(Text(f" {title}", style="bold"), id="jobs-title")
            yield Static("", id="jobs-overall")
            yield ProgressBar(total=100, show_eta=False, id="jobs-bar")
            yield Static("", id="jobs-detail")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_jobs()
        if self.refresh_hz > 0:
            self.set_interval(1 / self.refresh_hz, self.refresh_jobs)

    def refresh_jobs(self) -> None:
        states = read_jobs(self.kind)
        overall = self.query_one("#jobs-overall", Static)
        bar = self.query_one("#jobs-bar", ProgressBar)
        detail = self.query_one("#jobs-detail", Static)
        if not states:
            what = "k3tui download" if self.kind == "download" else "k3tui pack"
            overall.update(f"No {self.kind} jobs yet. Start one with `{what}`; it keeps running "
                           "when you close this screen or the SSH session.")
            bar.display = False
            detail.update("")
            return
        job = next((s for s in states if s.get("status") == "running"), states[0])
        overall.update(overall_line(job))
        total = job.get("total_bytes") or 0
        bar.display = bool(total)
        if total:
            bar.update(total=total, progress=job.get("done_bytes") or 0)
        detail.update(self._detail(job, states))

    def _detail(self, job: dict[str, Any], states: list[dict[str, Any]]) -> Table | Text:
        files = job.get("files") or []
        if self.kind != "download" or not files:
            lines = [clean(str(job.get("message") or ""))]
            others = len(states) - 1
            if others:
                lines.append(f"{others} earlier {self.kind} job(s)")
            return Text("\n".join(lines))
        counts = file_counts(job)
        table = Table(box=None, expand=True, show_header=True, pad_edge=False)
        table.add_column("file", ratio=1, no_wrap=True, overflow="ellipsis")
        table.add_column("GB", justify="right", width=14)
        table.add_column("%", justify="right", width=4)
        for f in files:
            status = f.get("status", "")
            if status in ("downloading", "verifying", "retrying"):
                size = f.get("size") or 0
                done = f.get("done") or 0
                pct = 100 * done / size if size else 0
                name = str(f.get("name", "?")) + ("" if status == "downloading"
                                                  else f" ({status})")
                # A file name from the Hub is neither markup nor terminal codes.
                table.add_row(Text(clean(name)), f"{done / GB:.1f}/{size / GB:.1f}",
                              f"{pct:.0f}")
        table.caption = escape(clean(f"{counts.get('done', 0)} done · "
                                     f"{counts.get('pending', 0)} queued · "
                                     f"{counts.get('failed', 0)} failed · "
                                     f"{job.get('message') or ''}"))
        return table
