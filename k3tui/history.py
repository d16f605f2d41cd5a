"""Chat history in SQLite: conversations and their messages, nothing lost.

WAL mode so the TUI can be killed at any moment; numbered migrations kept in
`PRAGMA user_version`. The user's message is committed before a request is sent, the
answer is saved while it streams (status "streaming"), and a store opened after a crash
marks any answer still "streaming" as "interrupted". A file that is not a database or is
corrupt is moved aside (never deleted) and a fresh store started; `notice` says where the
old one went. The files are private (0600). No UI imports here.

Which conversations a chat window shows is kept beside the database, not in it: a window
holds a shared flock on `<history>.windows/<id>` while it shows conversation `id`, so a
killed window lets go at once, and another window (or process) that can take the lock
exclusively knows that none shows it.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3tui.paths import private_dir, private_file
from k3tui.textsafe import clean

# Each entry upgrades the schema from version i to i+1. Never edit a released entry; append.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        backend TEXT NOT NULL DEFAULT '',
        model TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL DEFAULT '',
        reasoning TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'done',
        created REAL NOT NULL,
        meta TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
]

STATUSES = ("done", "streaming", "stopped", "quit", "interrupted", "error")
SIDECARS = ("", "-wal", "-shm")  # SQLite's WAL files travel with the database
_CORRUPT_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}


def _is_corrupt(exc: sqlite3.DatabaseError) -> bool:
    return getattr(exc, "sqlite_errorcode", None) in _CORRUPT_CODES


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    backend: str = ""
    model: str = ""
    message_count: int = 0


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    reasoning: str = ""
    status: str = "done"
    created: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


class History:
    """One SQLite file; every write is committed at once (autocommit)."""

    def __init__(self, path: Path | str | None = None, *, clock: Callable[[], float] = time.time):
        if path is None:
            from k3tui.paths import get_paths

            path = get_paths().history_db
        self.path = Path(path)
        private_dir(self.path.parent)
        self._clock = clock
        self.notice = ""  # for the user, when the store had to be replaced
        self._db = None
        problem = self._damage()
        if problem:
            moved = self._move_aside()
            recovered = moved.with_name(moved.name + ".recovered")
            self.notice = (
                f"The chat history {self.path} could not be read ({problem}); it was moved to "
                f"{moved} and a new, empty history started. To try to recover it: quit, run "
                f"`sqlite3 {moved} .recover | sqlite3 {recovered}`, then move {recovered} "
                f"to {self.path}.")
        self._open()

    def _damage(self) -> str:
        """Why the existing file is not a usable database ("" if it is, or is new).

        Checked read-only, before a writable connection could checkpoint a WAL into a
        damaged file or delete it: what is moved aside is exactly what was there."""
        try:
            if self.path.stat().st_size == 0:
                return ""
        except FileNotFoundError:
            return ""
        db = None
        try:
            db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
            problems = [r[0] for r in db.execute("PRAGMA quick_check(3)")]
            return "" if problems == ["ok"] else "; ".join(problems)
        except sqlite3.DatabaseError as exc:
            return str(exc) if _is_corrupt(exc) else ""  # anything else: _open says it
        finally:
            if db is not None:
                db.close()

    def _open(self) -> None:
        # Created 0600 before SQLite opens it: its -wal and -shm then get the same mode.
        for suffix in SIDECARS:
            private_file(Path(f"{self.path}{suffix}"), create=not suffix)
        try:
            # isolation_level=None: autocommit, so a kill never loses a committed message.
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: a commit survives the TUI being killed; no fsync stalls the UI.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            self._mark_interrupted()
        except sqlite3.DatabaseError as exc:
            from k3tui.errors import K3Error

            self.close()
            raise K3Error(f"The chat history {self.path} cannot be opened: {exc}.",
                          "check that the file and its folder are yours and the disk is not "
                          "full, then run this again") from None

    def _move_aside(self) -> Path:
        """Rename the database and its WAL files to `NAME.corrupt-<UTC time>[-wal|-shm]`."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        moved = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while any(Path(f"{moved}{s}").exists() for s in SIDECARS):  # two in one second
            n += 1
            moved = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        for suffix in SIDECARS:
            old = Path(f"{self.path}{suffix}")
            if old.exists():
                os.rename(old, f"{moved}{suffix}")
        return moved

    def _mark_interrupted(self) -> None:
        """An answer still "streaming" in a conversation no window shows belongs to a TUI
        or backend that died mid-answer. (One a window shows is being written now.)"""
        for (conversation_id,) in self._db.execute(
                "SELECT DISTINCT conversation_id FROM messages WHERE status='streaming'"
                ).fetchall():
            if not self.shown_elsewhere(conversation_id):
                self._db.execute("UPDATE messages SET status='interrupted' "
                                 "WHERE status='streaming' AND conversation_id=?",
                                 (conversation_id,))

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        """Read the version and raise it in one write transaction: another process opening
        a fresh file at the same moment waits here, then finds the schema already made."""
        if self.schema_version == len(MIGRATIONS):
            return  # the usual open takes no write lock
        self._db.execute("BEGIN IMMEDIATE")
        try:
            version = self.schema_version
            for number in range(version, len(MIGRATIONS)):
                for statement in MIGRATIONS[number].split(";"):
                    if statement.strip():
                        self._db.execute(statement)
            if version < len(MIGRATIONS):
                self._db.execute(f"PRAGMA user_version={len(MIGRATIONS)}")
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # SQLite rolls some failures back itself
                self._db.execute("ROLLBACK")
            raise
        if version > len(MIGRATIONS):
            from k3tui.errors import K3Error

            self.close()
            raise K3Error(f"The chat history {self.path} was written by a newer k3tui "
                          f"(schema {version}).", "upgrade k3tui, or move that file away")

    def close(self) -> None:
        if self._db is not None:
            self._db.close()

    # conversations -------------------------------------------------------------------
    def new_conversation(self, title: str = "New chat", *, backend: str = "",
                         model: str = "") -> int:
        now = self._clock()
        cur = self._db.execute(
            "INSERT INTO conversations(title, created, updated, backend, model) "
            "VALUES (?, ?, ?, ?, ?)", (title, now, now, backend, model))
        return int(cur.lastrowid)

    def list_conversations(self) -> list[Conversation]:
        rows = self._db.execute(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n "
            "FROM conversations c ORDER BY c.updated DESC, c.id DESC").fetchall()
        return [Conversation(r["id"], r["title"], r["created"], r["updated"], r["backend"],
                             r["model"], r["n"]) for r in rows]

    def get_conversation(self, conversation_id: int) -> Conversation | None:
        return next((c for c in self.list_conversations() if c.id == conversation_id), None)

    def rename(self, conversation_id: int, title: str) -> None:
        # Not "updated": the list is ordered by the last message, not the last rename.
        self._db.execute("UPDATE conversations SET title=? WHERE id=?",
                         (title.strip() or "Untitled", conversation_id))

    def delete(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))
        try:
            fd = self._window_lock(conversation_id, fcntl.LOCK_EX)
        except OSError:
            return
        if fd is not None:  # shown nowhere: its file goes too (under the lock: see below)
            os.unlink(self._window_file(conversation_id))
            os.close(fd)

    # windows -------------------------------------------------------------------------
    def _window_file(self, conversation_id: int) -> Path:
        return Path(f"{self.path}.windows") / str(int(conversation_id))

    def _window_lock(self, conversation_id: int, how: int) -> int | None:
        """An fd holding `how` on the conversation's window file; None if another holds a
        conflicting lock. OSError if the file cannot be made."""
        path = self._window_file(conversation_id)
        private_dir(path.parent)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, how | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            # `delete` unlinks the file under an exclusive lock: a lock taken on the
            # unlinked file would be seen by nobody, so take the new file's instead.
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def shown_elsewhere(self, conversation_id: int) -> bool:
        """Whether a chat window (another process, or another session here) shows it;
        False when that cannot be known (the folder is not writable)."""
        try:
            fd = self._window_lock(conversation_id, fcntl.LOCK_EX)
        except OSError:
            return False
        if fd is None:
            return True
        os.close(fd)
        return False

    def show(self, conversation_id: int) -> int | None:
        """Mark the conversation as shown in this window until the returned fd is closed
        (`hide`). None if the mark cannot be made (the folder is not writable): the window
        then works unmarked."""
        for _ in range(100):  # another window's `shown_elsewhere` holds it for an instant
            try:
                fd = self._window_lock(conversation_id, fcntl.LOCK_SH)
            except OSError:
                return None
            if fd is not None:
                return fd
            time.sleep(0.002)
        return None

    @staticmethod
    def hide(mark: int | None) -> None:
        if mark is not None:
            os.close(mark)

    def _touch(self, conversation_id: int) -> None:
        self._db.execute("UPDATE conversations SET updated=? WHERE id=?",
                         (self._clock(), conversation_id))

    # messages ------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str, *,
                    reasoning: str = "", status: str = "done",
                    meta: dict[str, Any] | None = None) -> int:
        """Insert and commit at once (the user's prompt is safe before any request)."""
        cur = self._db.execute(
            "INSERT INTO messages(conversation_id, role, content, reasoning, status, created, "
            "meta) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (conversation_id, role, content, reasoning, status, self._clock(),
             json.dumps(meta or {})))
        self._touch(conversation_id)
        return int(cur.lastrowid)

    def update_message(self, message_id: int, *, content: str | None = None,
                       reasoning: str | None = None, status: str | None = None,
                       meta: dict[str, Any] | None = None) -> None:
        sets, values = [], []
        for column, value in (("content", content), ("reasoning", reasoning),
                              ("status", status)):
            if value is not None:
                sets.append(f"{column}=?")
                values.append(value)
        if meta is not None:
            sets.append("meta=?")
            values.append(json.dumps(meta))
        if sets:
            self._db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id=?",
                             (*values, message_id))

    def delete_message(self, message_id: int) -> None:
        self._db.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id=? ORDER BY id",
            (conversation_id,)).fetchall()
        return [Message(r["id"], r["conversation_id"], r["role"], r["content"], r["reasoning"],
                        r["status"], r["created"], json.loads(r["meta"] or "{}")) for r in rows]

    def user_prompts(self, limit: int = 200) -> list[str]:
        """Recent prompts across all conversations, oldest first (for Up-arrow recall)."""
        rows = self._db.execute(
            "SELECT content FROM messages WHERE role='user' ORDER BY id DESC LIMIT ?",
            (limit,)).fetchall()
        return [r[0] for r in reversed(rows)]

    # export --------------------------------------------------------------------------
    def export_markdown(self, conversation_id: int) -> str:
        conv = self.get_conversation(conversation_id)
        if conv is None:
            from k3tui.errors import K3Error

            raise K3Error(f"There is no conversation {conversation_id}.",
                          "pick one from the conversations list")
        lines = [f"# {conv.title}", ""]
        if conv.backend or conv.model:
            lines += [f"_backend: {conv.backend or '?'} · model: {conv.model or '?'}_", ""]
        for m in self.messages(conversation_id):
            heading = {"user": "You", "assistant": "Assistant", "system": "System"}[m.role]
            note = "" if m.status == "done" else f" ({m.status})"
            lines += [f"## {heading}{note}", ""]
            if m.reasoning:
                lines += ["<details><summary>Reasoning</summary>", "", m.reasoning.rstrip(), "",
                          "</details>", ""]
            lines += [m.content.rstrip(), ""]
        # Rows saved before text was cleaned on arrival: `cat` of an export must be safe too.
        return clean("\n".join(lines).rstrip() + "\n")
