"""Backend start-up (load progress + log tail) and the backend log viewer."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Log, Static

from k3tui.errors import K3Error
from k3tui.textsafe import clean
from k3tui.units import KiB


def tail(path: str | Path | None, n: int = 200) -> list[str]:
    if not path:
        return []
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 64 * KiB))
            # A backend's log is its own text: sanitised before the F5 view shows it.
            return [clean(line) for line in fh.read().decode("utf-8", "replace").splitlines()[-n:]]
    except OSError:
        return []


class _Closed(Exception):
    """The start-up screen is gone (the app quit) while its backend was starting."""


class LogView(Vertical):
    """A log tail that re-reads the file twice a second."""

    def __init__(self, path: str | Path | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path
        self.hidden: set[str] = set()   # lines shown elsewhere on the screen already
        self._shown: list[str] = []

    def compose(self) -> ComposeResult:
        yield Log(id="log-tail", auto_scroll=True)

    def on_mount(self) -> None:
        self.border_title = f"log {self.path or '(none yet)'}"
        # Anchored, the newest line stays in view when the view shrinks or its horizontal
        # scrollbar appears after a write (a progress line growing to a failure's three lines
        # hid the last log lines: the error); the user scrolling up releases it.
        self.query_one(Log).anchor()
        self.reload()
        self.set_interval(0.5, self.reload)

    def reload(self) -> None:
        lines = [line for line in tail(self.path) if line not in self.hidden]
        if lines != self._shown:
            log = self.query_one(Log)
            log.clear()
            log.write_lines(lines)
            self._shown = lines


class LogScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("q", "app.pop_screen", "Back")]

    def __init__(self, path: str | Path | None) -> None:
        super().__init__()
        self.path = path

    def compose(self) -> ComposeResult:
        if not self.path:
            yield Static("This backend was not started by k3tui, so there is no log here "
                         "(check the server's own output).", id="log-none")
        view = LogView(self.path, id="log-view")
        # Long lines end at the window's edge: say that the arrows reach the rest.
        view.border_subtitle = "←/→ long lines · ↑/↓ PgUp/PgDn scroll · Esc back"
        yield view
        yield Footer()


class StartupScreen(Screen[Any]):
    """Runs `start(on_progress)` in a thread; shows progress lines and the log tail.

    Dismisses with whatever `start` returned (a RunningBackend). A K3Error stays on screen
    as its sentence and next step, with r to retry. What is typed while it starts is kept
    in `typed` (shown here) for the chat's prompt: a user types at once.
    """

    BINDINGS = [Binding("r", "retry", "Retry"), Binding("d", "demo", "Try the demo"),
                Binding("escape", "app.quit", "Quit")]

    def __init__(self, title: str, start: Callable[[Callable[[Any], None]], Any],
                 log_path: Callable[[], str | Path | None] | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.start = start
        self.log_path = log_path
        self.last_line = ""
        self.failure: K3Error | None = None  # why the last attempt failed (read by --smoke)
        self._host: Any = None  # the app, kept on mount for the start-up thread
        self.typed = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="startup"):
            yield Static(Text(f" {self.title_text}", style="bold"), id="startup-title")
            yield Static("starting…", id="startup-progress")
            yield Static("", id="startup-warnings")
            yield Static("", id="startup-typed", markup=False)
            yield LogView(None, id="startup-log")
        yield Footer()

    def on_mount(self) -> None:
        self._host = self.app
        self.query_one("#startup-warnings", Static).display = False
        self.query_one("#startup-typed", Static).display = False
        self.run_start()

    def action_retry(self) -> None:
        self.run_start()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # While it starts, r is a letter of the prompt being typed ahead, not a retry.
        if action == "demo":
            return self.failure is not None and self.app.demo is not None
        return action != "retry" or self.failure is not None

    def action_demo(self) -> None:
        """The configured backend did not start: one key starts the demo model instead."""
        self.start = self.app.use_demo()
        self.title_text = "starting the demo model (random weights, not Kimi-K3)"
        self.query_one("#startup-title", Static).update(Text(f" {self.title_text}",
                                                             style="bold"))
        self.run_start()

    def on_key(self, event: Any) -> None:
        if self.failure is not None:
            return
        if event.key == "backspace":
            self.typed = self.typed[:-1]
        elif event.is_printable and event.character:
            self.typed += event.character
        else:
            return
        event.stop()
        event.prevent_default()
        box = self.query_one("#startup-typed", Static)
        box.update(Text(f"typed: {self.typed}  (it waits in the prompt)", style="dim"))
        box.display = bool(self.typed)

    def _progress(self, progress: Any) -> None:
        line = progress.line() if hasattr(progress, "line") else str(progress)
        warnings = tuple(getattr(progress, "warnings", ()) or ())
        if warnings:
            self._ui(self._warn, warnings)
        self._ui(self._show, line)

    def _ui(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the app's thread (awaited if it returns an awaitable, as `dismiss`
        does), from the start-up worker; `_Closed` once this screen is gone (the user quit
        while the backend started), so that the start stops and leaves no server behind."""
        app = self._host  # from a thread, `self.app` is found through the DOM: gone at quit

        async def run() -> tuple[bool, Any]:
            if not (self.is_attached and app.is_running):  # quitting, or shutting down
                return False, None
            out = fn(*args)
            return True, (await out) if inspect.isawaitable(out) else out

        try:
            done, out = app.call_from_thread(run)
        except RuntimeError:
            if app.is_running:  # not the ended loop: a real error of `fn`
                raise
            raise _Closed from None
        if not done:
            raise _Closed
        return out

    def _warn(self, warnings: tuple[str, ...]) -> None:
        """Warnings stay in view for the whole load (progress lines replace each other),
        once: the log's copy of them (its `# k3tui:` header) is left out of the tail."""
        box = self.query_one("#startup-warnings", Static)
        box.update(Text("\n".join(warnings), style="bold yellow"))
        box.display = bool(warnings)
        view = self.query_one(LogView)
        view.hidden = {f"# k3tui: {w}" for w in warnings}
        view.reload()

    def _show(self, line: str, style: str = "") -> None:
        self.last_line = line
        self.query_one("#startup-progress", Static).update(Text(line, style=style))
        if self.log_path is not None:
            view = self.query_one(LogView)
            path = self.log_path()
            if path and view.path != path:
                view.path = path
                view.border_title = f"log {path}"

    @work(thread=True, exclusive=True, group="startup")
    def run_start(self) -> None:
        try:
            self._start()
        except _Closed:  # quit while starting: nothing left to show, and no server left behind
            pass

    def _start(self) -> None:
        self._ui(self._warn, ())   # a retry decides afresh
        self._ui(self._show, "starting…")
        self.failure = None
        try:
            backend = self.start(self._progress)  # a `_Closed` from `_progress` stops it
        except _Closed:
            raise
        except Exception as exc:  # never a traceback on screen
            failure = exc if isinstance(exc, K3Error) else \
                K3Error(f"The backend did not start: {exc}", "read the log below")
            demo = ", d to try the demo model" if self._host.demo is not None else ""
            self.failure = failure
            self._ui(self._show, f"{failure.message}\nnext: {failure.next_step}\npress r to "
                     f"retry{demo}, Esc to quit", "bold red")
            self._ui(self.refresh_bindings)
            return
        try:
            self._ui(self.dismiss, backend)
        except _Closed:
            stop = getattr(backend, "stop", None)
            if stop is not None:  # nobody will attach it now
                stop()
            raise
