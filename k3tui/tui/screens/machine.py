"""Machine summary: the doctor's findings (FND's probe + plan), computed in a thread."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static


def machine_summary() -> str:
    """The same text `k3tui plan` prints, for the configured (or recommended) model kind."""
    try:
        from k3tui.planning.plan import format_plan, make_plan, recommend_model_kind
        from k3tui.probe import probe_machine
    except ImportError:
        return "The machine probe is not available in this version (run `k3tui doctor`)."
    report = probe_machine()
    kind = recommend_model_kind(report)
    try:
        from k3tui.config import config_exists, load_config

        if config_exists():
            kind = load_config().model.kind
    except Exception:
        pass
    return format_plan(make_plan(report, kind), report)


class MachineScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("q", "app.pop_screen", "Back")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="machine"):
            yield Static("probing this machine…", id="machine-text", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.probe()

    @work(thread=True, exclusive=True)
    def probe(self) -> None:
        try:
            text = machine_summary()
        except Exception as exc:  # the probe must never take the chat down
            text = f"The machine probe failed: {exc}. Run `k3tui doctor` for details."
        self.app.call_from_thread(self.query_one("#machine-text", Static).update, text)
