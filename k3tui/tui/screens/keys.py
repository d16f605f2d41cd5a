"""F1: every key of the chat on one screen (the footer has room for only a few at 80×24)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: list[tuple[str, str]] = [
    ("Enter", "send the prompt"),
    ("Ctrl+J", "new line (also Shift+Enter if the terminal sends it)"),
    ("Up / Down", "earlier prompts"),
    ("PgUp / PgDn", "scroll the conversation (the mouse wheel too)"),
    ("Esc", "stop the answer (what came is kept); unhighlight"),
    ("Ctrl+R", "regenerate (restarts a backend that died)"),
    ("Ctrl+E", "edit the last prompt and send it again"),
    ("Ctrl+Up/Down", "highlight an earlier / later one (Alt+Up/Down too)"),
    ("Ctrl+Y", "copy the highlighted message, else the last answer"),
    ("Ctrl+G", "copy its last code block; again: the block before"),
    ("", "(copies: OSC 52, tmux's buffer, a local clipboard)"),
    ("Ctrl+T", "show / hide the reasoning (highlighted / last answer)"),
    ("Ctrl+O", "conversations: open, r rename, d d delete, x export"),
    ("Ctrl+N", "new conversation"),
    ("F2", "hide / show the latency and I/O panes"),
    ("F3 / F4", "download / packing jobs (they outlive k3tui)"),
    ("F5", "the backend's log"),
    ("F6", "this machine: the doctor's findings"),
    ("Ctrl+Q", "quit (stops a backend k3tui started)"),
]


class KeysScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "app.pop_screen", "Close")]

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=False, pad_edge=False, expand=True)
        table.add_column(style="bold", no_wrap=True)
        table.add_column(ratio=1)
        for key, what in KEYS:
            table.add_row(key, what)
        with VerticalScroll(id="keys") as box:
            box.border_title = "keys · Esc closes"
            yield Static(table)
