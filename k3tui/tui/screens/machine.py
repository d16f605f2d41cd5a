"""Machine summary: the doctor's findings (the probe and the plan), computed in a thread."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from k3tui.errors import K3Error


def machine_summary() -> str:
    """The same text `k3tui plan` prints, for the configured (or recommended) model kind."""
    from k3tui.config import config_exists, load_config
    from k3tui.planning.plan import format_plan, make_plan, recommend_model_kind
    from k3tui.probe import probe_machine

    report = probe_machine()
    kind = load_config().model.kind if config_exists() else recommend_model_kind(report)
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
        except K3Error as exc:  # e.g. a damaged config: its own sentence and next step
            text = str(exc)
        except Exception as exc:  # the probe must never take the chat down
            text = f"The machine probe failed: {exc}. Run `k3tui doctor` for details."
        self.app.call_from_thread(self.query_one("#machine-text", Static).update, text)
