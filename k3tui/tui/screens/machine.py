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
    """The same text `k3tui plan` prints, for the configured (or recommended) model kind:
    this machine, the configured folder's disk and the stored forecast."""
    from k3tui.config import config_exists, load_config
    from k3tui.paths import get_paths
    from k3tui.planning.forecast import plan_lines
    from k3tui.planning.plan import format_plan, make_plan, recommend_model_kind
    from k3tui.probe import probe_machine

    cfg = load_config() if config_exists() else None
    report = probe_machine(cfg.model.dir if cfg and cfg.model.dir else get_paths().models_dir)
    report.description = f"this machine ({report.hostname})"
    kind = cfg.model.kind if cfg else recommend_model_kind(report)
    plan = make_plan(report, kind)
    lines = plan_lines(plan.preset) if plan.backend == "bundled" else None
    return format_plan(plan, report, forecast=lines)


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
