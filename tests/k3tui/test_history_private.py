"""A broken history is moved aside, never lost; k3tui's files are the user's alone."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest
from tui_helpers import build_app, settle

from k3tui import paths
from k3tui.history import History
from k3tui.paths import get_paths, private_open, secure_home


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _random_bytes(path) -> None:
    path.write_bytes(os.urandom(8192))


def _truncated_db(path) -> None:
    """A real history cut in half: the header is valid, later pages are missing."""
    h = History(path)
    cid = h.new_conversation("t")
    for i in range(300):
        h.add_message(cid, "user", f"message {i} " * 40)
    h._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    h.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", [_random_bytes, _truncated_db])
async def test_a_corrupt_history_is_moved_aside_and_the_chat_starts(tmp_path, damage):
    db = tmp_path / "history.sqlite3"
    damage(db)
    before = db.read_bytes()
    (tmp_path / "history.sqlite3-wal").write_bytes(b"wal bytes")
    history = History(db)            # before: sqlite3.DatabaseError, a raw traceback
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("history.sqlite3.corrupt-")]
    main = [p for p in moved if not p.name.endswith(("-wal", "-shm"))]
    assert len(main) == 1 and main[0].read_bytes() == before          # intact, not deleted
    assert (tmp_path / f"{main[0].name}-wal").read_bytes() == b"wal bytes"
    assert str(main[0]) in history.notice and ".recover" in history.notice
    assert history.list_conversations() == []                          # a fresh store works
    app = build_app(tmp_path, history=history)
    async with app.run_test() as pilot:
        await settle(app, pilot)
        assert any(str(main[0]) in n.message for n in app._notifications)


def test_a_healthy_history_is_left_where_it_is(tmp_path):
    db = tmp_path / "history.sqlite3"
    History(db).new_conversation("kept")
    history = History(db)
    assert history.notice == "" and [c.title for c in history.list_conversations()] == ["kept"]
    assert not [p for p in tmp_path.iterdir() if "corrupt" in p.name]


@pytest.fixture
def home(tmp_path, monkeypatch):
    root = tmp_path / "home"
    monkeypatch.setenv("K3TUI_HOME", str(root))
    monkeypatch.setattr(paths, "_told", False)
    return get_paths()


def test_history_home_and_logs_are_created_private(home, monkeypatch):
    monkeypatch.setattr(os, "umask", os.umask)  # keep the usual umask (022) in force
    history = History()
    cid = history.new_conversation("secret chat")
    history.add_message(cid, "user", "my secret")
    assert _mode(home.root) == 0o700
    for suffix in ("", "-wal", "-shm"):
        assert _mode(f"{home.history_db}{suffix}") == 0o600, suffix
    with private_open(home.logs_dir / "engine.log") as fh:
        fh.write(b"x")
    assert _mode(home.logs_dir) == 0o700 and _mode(home.logs_dir / "engine.log") == 0o600


def test_config_and_job_state_are_written_private(home):
    from k3tui import jobs
    from k3tui.config import Config, save_config

    save_config(Config())
    assert _mode(home.config_file) == 0o600
    jobs._write_state({"id": "download-1", "kind": "download"})
    assert _mode(jobs.state_path("download-1")) == 0o600 and _mode(home.jobs_dir) == 0o700


def test_looser_files_are_tightened_with_one_notice(home, capsys):
    home.root.mkdir(mode=0o755)
    os.chmod(home.root, 0o755)
    sqlite3.connect(home.history_db).close()
    os.chmod(home.history_db, 0o644)
    home.logs_dir.mkdir(mode=0o755)
    os.chmod(home.logs_dir, 0o755)
    for name in ("a.log", "b.log"):
        (home.logs_dir / name).write_text("chat text")
        os.chmod(home.logs_dir / name, 0o644)
    models = home.models_dir
    models.mkdir()
    (models / "shard.gguf").write_text("weights")
    os.chmod(models / "shard.gguf", 0o644)
    secure_home()
    assert _mode(home.root) == 0o700 and _mode(home.logs_dir) == 0o700
    assert _mode(home.history_db) == 0o600
    assert _mode(home.logs_dir / "a.log") == _mode(home.logs_dir / "b.log") == 0o600
    assert _mode(models / "shard.gguf") == 0o644     # downloaded weights are not secrets
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "readable by other users" in err
    secure_home()
    assert capsys.readouterr().err == ""
