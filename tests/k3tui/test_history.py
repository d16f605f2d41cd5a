"""History: WAL and migrations, unfinished answers, a newer schema refused, Markdown export."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from k3tui.errors import K3Error
from k3tui.history import MIGRATIONS, History


def test_tui_history_wal_migrations_and_crud(tmp_path):
    h = History(tmp_path / "h.db")
    assert h.schema_version == len(MIGRATIONS)
    mode = sqlite3.connect(tmp_path / "h.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    a = h.new_conversation("first")
    b = h.new_conversation("second")
    h.add_message(a, "user", "hi")
    h.add_message(a, "assistant", "hello", reasoning="they greeted me")
    h.rename(b, "  renamed ")
    assert {c.title for c in h.list_conversations()} == {"first", "renamed"}
    h.delete(a)
    assert h.messages(a) == []  # cascade
    assert [c.id for c in h.list_conversations()] == [b]


def test_tui_history_marks_unfinished_answers_interrupted(tmp_path):
    h = History(tmp_path / "h.db")
    cid = h.new_conversation()
    h.add_message(cid, "user", "q")
    h.add_message(cid, "assistant", "partial", status="streaming")
    del h  # the TUI was killed mid-answer: no clean close
    again = History(tmp_path / "h.db")
    msgs = again.messages(cid)
    assert [m.status for m in msgs] == ["done", "interrupted"]
    assert msgs[1].content == "partial"


def test_tui_history_refuses_newer_schema(tmp_path):
    db = sqlite3.connect(tmp_path / "h.db")
    db.execute(f"PRAGMA user_version={len(MIGRATIONS) + 5}")
    db.close()
    with pytest.raises(K3Error, match="newer k3tui"):
        History(tmp_path / "h.db")


def test_tui_history_export_includes_reasoning_and_status(tmp_path):
    h = History(tmp_path / "h.db")
    cid = h.new_conversation("Über 日本")
    h.add_message(cid, "user", "why?")
    h.add_message(cid, "assistant", "because", reasoning="step 1\nstep 2", status="stopped")
    md = h.export_markdown(cid)
    assert md.startswith("# Über 日本")
    assert "## Assistant (stopped)" in md
    assert "<details><summary>Reasoning</summary>" in md and "step 2" in md
    assert md.index("step 2") < md.index("because")


def test_tui_history_a_fresh_file_opened_by_another_process_between_version_and_migration(
        tmp_path, monkeypatch):
    """The race of three chats starting at once, forced: this process has read the schema
    version of a fresh file (0) when another process opens the same file and migrates it.
    Reading the version outside the migration's transaction made this one then fail with
    'table conversations already exists'."""
    path = tmp_path / "h.db"
    read = History.schema_version.fget
    others: list[subprocess.CompletedProcess] = []

    def version_then_another_process(self):
        version = read(self)
        if not others:  # once: right after this connection's first read
            code = f"from k3tui.history import History; History({str(path)!r})"
            others.append(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                         text=True, timeout=120))
        return version

    monkeypatch.setattr(History, "schema_version", property(version_then_another_process))
    h = History(path)
    assert others[0].returncode == 0, others[0].stderr
    assert read(h) == len(MIGRATIONS)
    h.new_conversation("works")
    assert [c.title for c in h.list_conversations()] == ["works"]


def test_tui_history_window_marks_are_seen_across_connections_and_go_with_the_conversation(
        tmp_path):
    a, b = History(tmp_path / "h.db"), History(tmp_path / "h.db")
    cid = a.new_conversation("shown")
    assert not b.shown_elsewhere(cid)
    mark = a.show(cid)
    assert b.shown_elsewhere(cid) and a.shown_elsewhere(cid)  # any other look: shown
    second = b.show(cid)  # two windows may show one conversation (asked for by name)
    a.hide(mark)
    assert a.shown_elsewhere(cid)
    b.hide(second)
    assert not a.shown_elsewhere(cid)
    a.delete(cid)
    assert not (tmp_path / "h.db.windows" / str(cid)).exists()
