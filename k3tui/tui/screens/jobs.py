"""Downloads and packing: attach to detached jobs by reading their state files.

The jobs run in their own processes (`k3tui.jobs`); this screen only reads their checked
states (`jobs.scan`) twice a second, so closing it never stops a job. A damaged state file
is one line saying so, never an exception in the chat.
"""

from __future__ import annotations

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
from k3tui.units import rate, transfer_progress


def read_jobs(kind: str) -> tuple[list[jobs.JobState], list[jobs.Damaged]]:
    """The job states of `kind`, newest first, and the damaged state files (of any kind:
    a damaged file's kind is unknown)."""
    states, damaged = jobs.scan()
    return [s for s in states if s["kind"] == kind], damaged


def format_eta(seconds: float | None) -> str:
    """Capped like `ollama pull`: nobody plans around "412h"."""
    if seconds is None or seconds < 0:
        return "–"
    if seconds >= 99 * 3600:
        return "99h+"
    h, rem = divmod(int(seconds), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def overall_line(state: jobs.JobState) -> Text:
    status = state["status"]
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"{status:<9}", style="bold")
    text.append(f" {transfer_progress(state['done_bytes'], state['total_bytes'])}")
    if state["stalled"]:
        text.append("  stalled", style="bold red")
    elif status == "running":
        text.append(f"  {rate(state['rate_bps'])}  ETA {format_eta(state['eta_s'])}")
    layer = jobs.layer_progress(state)
    if layer:
        text.append(f"  {layer}")
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
            yield Static("", id="jobs-damaged")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_jobs()
        if self.refresh_hz > 0:
            self.set_interval(1 / self.refresh_hz, self.refresh_jobs)

    def refresh_jobs(self) -> None:
        states, damaged = read_jobs(self.kind)
        overall = self.query_one("#jobs-overall", Static)
        bar = self.query_one("#jobs-bar", ProgressBar)
        detail = self.query_one("#jobs-detail", Static)
        note = self.query_one("#jobs-damaged", Static)
        note.display = bool(damaged)
        note.update(Text("\n".join(f"damaged state file {d.id} skipped: {d.reason}"
                                   for d in damaged[:3])
                         + (f"\n… and {len(damaged) - 3} more (`k3tui jobs` lists them)"
                            if len(damaged) > 3 else ""), style="yellow"))
        if not states:
            what = "k3tui download" if self.kind == "download" else "k3tui pack"
            overall.update(f"No {self.kind} jobs yet. Start one with `{what}`; it keeps running "
                           "when you close this screen or the SSH session.")
            bar.display = False
            detail.update("")
            return
        job = next((s for s in states if s["status"] == "running"), states[0])
        overall.update(overall_line(job))
        total = job["total_bytes"]
        bar.display = bool(total)
        if total:
            bar.update(total=total, progress=job["done_bytes"])
        detail.update(self._detail(job, states))

    def _detail(self, job: jobs.JobState, states: list[jobs.JobState]) -> Table | Text:
        files = job["files"]
        if self.kind != "download" or not files:
            lines = [job["message"]]
            others = len(states) - 1
            if others:
                lines.append(f"{others} earlier {self.kind} job(s)")
            return Text("\n".join(lines))
        counts = file_counts(job)
        table = Table(box=None, expand=True, show_header=True, pad_edge=False)
        table.add_column("file", ratio=1, no_wrap=True, overflow="ellipsis")
        table.add_column("done / size", justify="right", width=18)
        table.add_column("%", justify="right", width=4)
        for f in files:
            status = f.get("status", "")
            if status in ("downloading", "verifying", "retrying"):
                size, done = f["size"], f["done"]
                pct = 100 * done / size if size else 0
                name = f["name"] + ("" if status == "downloading" else f" ({status})")
                # A file name from the Hub is neither markup nor terminal codes.
                table.add_row(Text(clean(name)), transfer_progress(done, size), f"{pct:.0f}")
        table.caption = escape(clean(f"{counts.get('done', 0)} done · "
                                     f"{counts.get('pending', 0)} queued · "
                                     f"{counts.get('failed', 0)} failed · "
                                     f"{job.get('message') or ''}"))
        return table
