"""Turns and their queue, kept in the chat history's SQLite file (schema 2 of history.py).

A turn is one answer: the user's message, the assistant message it fills, the backend it
is asked of and how (settings), and its state: queued → running → done | stopped |
failed. The queue is the turns of one backend in id order; one runner per backend
answers them one at a time (k3tui/answers/runner.py), across conversations. The answer's
text and ids live in its assistant message, written as they arrive (a batch at most a
second old), so a killed runner or machine loses at most that second and the next runner
continues the answer from its ids. No UI imports here.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3tui.errors import K3Error
from k3tui.history import History

STATES = ("queued", "running", "done", "stopped", "failed")
ACTIVE = ("queued", "running")
# The message status each turn state shows in the chat history.
MESSAGE_STATUS = {"queued": "streaming", "running": "streaming", "done": "done",
                  "stopped": "stopped", "failed": "error"}


@dataclass(frozen=True)
class Turn:
    id: int
    conversation_id: int
    message_id: int
    backend: str
    state: str
    settings: dict[str, Any]
    created: float
    updated: float
    started: float | None = None
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    reasoning: str = ""
    content: str = ""
    token_ids: list[int] = field(default_factory=list)
    stop_requested: bool = False
    stop_reason: str = ""
    runner: str = ""
    next_step: str = ""     # a failed turn: what to do about it

    @property
    def s_per_token(self) -> float | None:
        """Seconds per generated token since the first one (None before the second)."""
        if self.first_token is None or self.tokens < 2:
            return None
        end = self.ended if self.ended is not None else self.updated
        return max(0.0, end - self.first_token) / (self.tokens - 1)

    def elapsed_s(self, now: float) -> float:
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else now) - self.started

    @property
    def eta_s(self) -> float | None:
        """Time to `max_tokens` at the pace so far (an upper bound: the model may end sooner)."""
        limit, pace = self.settings.get("max_tokens"), self.s_per_token
        if self.state != "running" or pace is None or not isinstance(limit, int):
            return None
        return max(0, limit - self.tokens) * pace


def _ids(raw: str) -> list[int]:
    """A stored id list; anything else (a hand-edited row) is no ids, never a crash."""
    try:
        ids = json.loads(raw)
    except (ValueError, RecursionError):
        return []
    return ids if isinstance(ids, list) and all(type(i) is int for i in ids) else []


def _settings(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


_SELECT = ("SELECT t.*, m.content, m.reasoning, m.token_ids FROM turns t "
           "JOIN messages m ON m.id = t.message_id")


def _turn(r: sqlite3.Row) -> Turn:
    return Turn(r["id"], r["conversation_id"], r["message_id"], r["backend"], r["state"],
                _settings(r["settings"]), r["created"], r["updated"], r["started"],
                r["first_token"], r["ended"], r["tokens"], r["reasoning"], r["content"],
                _ids(r["token_ids"]), bool(r["stop_requested"]), r["stop_reason"], r["runner"],
                r["next_step"])


class TurnStore:
    """The turns in one history file. `claim_hook` runs between choosing a turn and taking
    it (tests force two runners' interleaving there)."""

    def __init__(self, history: History, *, clock: Callable[[], float] = time.time,
                 claim_hook: Callable[[int], None] | None = None):
        self.history = history
        self.db = history.db
        self.clock = clock
        self.claim_hook = claim_hook

    def _write(self, sql: str, params: tuple = ()) -> sqlite3.Cursor:
        try:
            return self.db.execute(sql, params)
        except sqlite3.OperationalError as exc:   # locked past busy_timeout, disk full
            raise K3Error(f"The chat history {self.history.path} could not be written: {exc}.",
                          "free disk space or close what holds it, then try again") from None

    # -- the shell and the chat ---------------------------------------------------------
    def enqueue(self, conversation_id: int, prompt: str | None, backend: str,
                settings: dict[str, Any]) -> Turn:
        """The prompt and its (empty) answer, committed together, queued behind the
        backend's other turns. `prompt` None: an answer to the conversation as it is (the
        chat saved the prompt already, or regenerates)."""
        now = self.clock()
        self._write("BEGIN IMMEDIATE")
        try:
            if prompt is not None:
                self._write("INSERT INTO messages(conversation_id, role, content, created) "
                            "VALUES (?, 'user', ?, ?)", (conversation_id, prompt, now))
            msg = self._write("INSERT INTO messages(conversation_id, role, status, created) "
                              "VALUES (?, 'assistant', 'streaming', ?)", (conversation_id, now))
            cur = self._write(
                "INSERT INTO turns(conversation_id, message_id, backend, settings, state, "
                "created, updated) VALUES (?, ?, ?, ?, 'queued', ?, ?)",
                (conversation_id, msg.lastrowid, backend, json.dumps(settings), now, now))
            self._write("UPDATE conversations SET updated=? WHERE id=?", (now, conversation_id))
            self._write("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        assert cur.lastrowid is not None  # the row the INSERT above made
        return self.get(cur.lastrowid)

    def get(self, turn_id: int) -> Turn:
        row = self.db.execute(_SELECT + " WHERE t.id=?", (turn_id,)).fetchone()
        if row is None:
            raise K3Error(f"There is no answer {turn_id}.", "list them with `k3tui answers`", 2)
        return _turn(row)

    def list_turns(self, limit: int = 50) -> list[Turn]:
        """Every queued and running turn, and the most recent finished ones; oldest first."""
        rows = self.db.execute(
            _SELECT + " WHERE t.state IN ('queued', 'running') OR t.id IN "
            "(SELECT id FROM turns WHERE state NOT IN ('queued', 'running') "
            "ORDER BY id DESC LIMIT ?) ORDER BY t.id", (limit,)).fetchall()
        return [_turn(r) for r in rows]

    def turn_of_message(self, message_id: int) -> Turn | None:
        row = self.db.execute(_SELECT + " WHERE t.message_id=?", (message_id,)).fetchone()
        return None if row is None else _turn(row)

    def backends_waiting(self) -> list[str]:
        """The backends with turns queued or running (each needs a runner)."""
        rows = self.db.execute("SELECT DISTINCT backend FROM turns "
                               "WHERE state IN ('queued', 'running') ORDER BY backend")
        return [r[0] for r in rows]

    def request_stop(self, turn_id: int) -> Turn:
        """A queued turn is stopped at once; a running one when its runner reads the request
        (within a second)."""
        turn = self.get(turn_id)
        if turn.state == "queued":
            self.finish(turn_id, "stopped", "stopped before it started", only_from="queued")
        elif turn.state == "running":
            self._write("UPDATE turns SET stop_requested=1, updated=? WHERE id=?",
                        (self.clock(), turn_id))
        return self.get(turn_id)

    # -- the runner ---------------------------------------------------------------------
    def claim(self, backend: str, runner: str, *, adopt: bool = False) -> Turn | None:
        """The backend's oldest queued turn, taken by `runner`; with `adopt` (only for the
        holder of the backend's runner lock, so no other runner is alive) first a turn left
        running by a runner that is gone. Compare-and-set on the state, so two runners never
        take the same turn."""
        states = "('queued', 'running')" if adopt else "('queued')"
        while True:
            row = self.db.execute(
                f"SELECT id, state FROM turns WHERE backend=? AND state IN {states} "
                "AND runner != ? ORDER BY state='queued', id LIMIT 1",
                (backend, runner)).fetchone()
            if row is None:
                return None
            if self.claim_hook is not None:
                self.claim_hook(row["id"])
            now = self.clock()
            cur = self._write(
                "UPDATE turns SET state='running', runner=?, started=COALESCE(started, ?), "
                "updated=? WHERE id=? AND state=? AND runner != ?",
                (runner, now, now, row["id"], row["state"], runner))
            if cur.rowcount == 1:
                return self.get(row["id"])
            # another runner took it between the read and the write: choose again

    def has_queued(self, backend: str) -> bool:
        return self.db.execute("SELECT 1 FROM turns WHERE backend=? AND state='queued' LIMIT 1",
                               (backend,)).fetchone() is not None

    def save_progress(self, turn: Turn, *, reasoning: str, content: str, token_ids: list[int],
                      tokens: int, first_token: float | None) -> None:
        """The answer so far, in one transaction (text, ids and count always agree)."""
        now = self.clock()
        self._write("BEGIN IMMEDIATE")
        try:
            self._write("UPDATE messages SET content=?, reasoning=?, token_ids=? WHERE id=?",
                        (content, reasoning, json.dumps(token_ids), turn.message_id))
            self._write("UPDATE turns SET tokens=?, first_token=COALESCE(first_token, ?), "
                        "updated=? WHERE id=?", (tokens, first_token, now, turn.id))
            self._write("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def stop_is_requested(self, turn_id: int) -> bool:
        row = self.db.execute("SELECT stop_requested FROM turns WHERE id=?",
                              (turn_id,)).fetchone()
        return row is None or bool(row[0])   # a deleted conversation stops its turn

    def finish(self, turn_id: int, state: str, reason: str, *,
               only_from: str = "running", next_step: str = "") -> None:
        assert state in STATES and state not in ACTIVE
        now = self.clock()
        self._write("BEGIN IMMEDIATE")
        try:
            cur = self._write("UPDATE turns SET state=?, stop_reason=?, next_step=?, ended=?, "
                              "updated=? WHERE id=? AND state=?",
                              (state, reason, next_step, now, now, turn_id, only_from))
            if cur.rowcount:
                self._write("UPDATE messages SET status=?, meta=? WHERE id=(SELECT message_id "
                            "FROM turns WHERE id=?)",
                            (MESSAGE_STATUS[state], json.dumps({"stop_reason": reason}),
                             turn_id))
            self._write("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def request_messages(self, turn: Turn) -> list[dict[str, Any]]:
        """What the backend is sent for `turn`: the system prompt, then the conversation up
        to the turn's prompt; earlier replies with their ids when they have them."""
        out: list[dict[str, Any]] = []
        system = turn.settings.get("system_prompt")
        if isinstance(system, str) and system:
            out.append({"role": "system", "content": system})
        rows = self.db.execute(
            "SELECT role, content, reasoning, token_ids, status FROM messages "
            "WHERE conversation_id=? AND id < ? ORDER BY id",
            (turn.conversation_id, turn.message_id)).fetchall()
        for r in rows:
            if r["role"] != "assistant":
                out.append({"role": r["role"], "content": r["content"]})
                continue
            if not (r["content"] or r["reasoning"]):
                continue                            # an answer that never came
            msg: dict[str, Any] = {"role": "assistant", "content": r["content"]}
            if r["reasoning"]:
                msg["reasoning_content"] = r["reasoning"]
            ids = _ids(r["token_ids"])
            if ids:
                msg["k3_token_ids"] = ids
            out.append(msg)
        return out
