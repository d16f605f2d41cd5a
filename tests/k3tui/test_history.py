"""History: WAL and migrations, unfinished answers, a newer schema refused, Markdown export."""

from __future__ import annotations

import sqlite3

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
