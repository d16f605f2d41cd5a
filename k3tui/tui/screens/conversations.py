"""Conversations list: open, rename, delete, export to Markdown."""

from __future__ import annotations

import re
import time

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, OptionList, Static
from textual.widgets.option_list import Option

from k3tui.history import History
from k3tui.paths import get_paths, private_dir, private_open
from k3tui.textsafe import clean


TITLE_CELLS = 60  # one line of the list at 80 columns


def export_path(history: History, conversation_id: int):
    conv = history.get_conversation(conversation_id)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", conv.title if conv else "chat").strip("-")[:40]
    return private_dir(get_paths().root / "exports") / f"{conversation_id}-{slug or 'chat'}.md"


class ConversationsScreen(ModalScreen[int | None]):
    """Dismisses with the conversation id to open, or None."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("r", "rename", "Rename"),
        Binding("d", "delete", "Delete"),
        Binding("x", "export", "Export"),
    ]

    def __init__(self, history: History, current: int | None = None) -> None:
        super().__init__()
        self.history = history
        self.current = current
        self._armed_delete: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations"):
            yield Static("conversations — Enter opens · r renames · d d deletes · x exports",
                         id="conv-title")
            yield OptionList(id="conv-list")
            yield Input(placeholder="new title, Enter to save", id="conv-rename")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#conv-rename", Input).display = False
        self._fill()
        self.query_one(OptionList).focus()

    def _fill(self, keep: int | None = None) -> None:
        """(Re)list the conversations, highlighting `keep` (else the open one)."""
        target = str(keep if keep is not None else self.current)
        options = self.query_one(OptionList)
        options.clear_options()
        for conv in self.history.list_conversations():
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.updated))
            # The count and date on a line of their own: a wide title (CJK, emoji) or a
            # narrow window never pushes them about; a long title is cut by terminal cells.
            line = Text(clean(conv.title) or "Untitled")
            line.truncate(TITLE_CELLS, overflow="ellipsis")
            line.append(f"\n{conv.message_count} msgs · {when}", style="dim")
            options.add_option(Option(line, id=str(conv.id)))  # a title is not markup
        for i in range(options.option_count):
            if options.get_option_at_index(i).id == target:
                options.highlighted = i
        if options.highlighted is None and options.option_count:
            options.highlighted = 0  # a new chat is not listed yet: Enter opens the newest

    def _selected(self) -> int | None:
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return None
        return int(options.get_option_at_index(options.highlighted).id)

    @on(OptionList.OptionSelected)
    def opened(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_close(self) -> None:
        box = self.query_one("#conv-rename", Input)
        if box.display:
            box.display = False
            self.query_one(OptionList).focus()
            return
        self.dismiss(None)

    def action_rename(self) -> None:
        cid = self._selected()
        conv = self.history.get_conversation(cid) if cid is not None else None
        if conv is None:
            return
        box = self.query_one("#conv-rename", Input)
        box.value = conv.title
        box.display = True
        box.focus()

    @on(Input.Submitted, "#conv-rename")
    def renamed(self, event: Input.Submitted) -> None:
        cid = self._selected()
        if cid is not None:
            self.history.rename(cid, event.value)
        event.input.display = False
        self._fill(keep=cid)
        self.query_one(OptionList).focus()

    def action_delete(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        if self._armed_delete != cid:
            self._armed_delete = cid
            self.notify("Press d again to delete this conversation.", severity="warning")
            return
        self.history.delete(cid)
        self._armed_delete = None
        self.notify("Conversation deleted.")
        self._fill()

    def action_export(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        try:
            path = export_path(self.history, cid)
            with private_open(path, "w", encoding="utf-8") as fh:
                fh.write(self.history.export_markdown(cid))
        except OSError as exc:  # a full disk, or `exports` that is not a folder: no traceback
            where = exc.filename or get_paths().root / "exports"
            self.notify(f"Could not export to {where}: {exc.strerror or exc}. Free some space "
                        f"or fix that path, then press x again.", severity="error",
                        markup=False)
            return
        self.notify(f"Exported to {path}", markup=False)
