"""The turn store on real SQLite: the queue, its order, progress and stop, and the schema
step that adds it to a history written by an older k3tui."""

from __future__ import annotations

import sqlite3

import pytest

from k3tui.answers.store import TurnStore
from k3tui.history import MIGRATIONS, History

URL = "http://127.0.0.1:9/v1"


@pytest.fixture
def store(tmp_path):
    h = History(tmp_path / "h.db")
    yield TurnStore(h)
    h.close()


def queue(store, n, backend=URL):
    conv = store.history.new_conversation()
    return [store.enqueue(conv, f"prompt {i}", backend, {"max_tokens": 10}) for i in range(n)]


def test_turns_are_taken_in_order_one_backend_at_a_time(store):
    a = queue(store, 2)
    other = queue(store, 1, backend="http://127.0.0.1:10/v1")
    b = queue(store, 1)
    assert [t.state for t in a + b + other] == ["queued"] * 4
    taken = [store.claim(URL, "r1") for _ in range(3)]
    assert [t.id for t in taken] == [a[0].id, a[1].id, b[0].id]
    assert store.claim(URL, "r1") is None
    assert store.claim("http://127.0.0.1:10/v1", "r2").id == other[0].id


def test_two_runners_never_take_the_same_turn(tmp_path):
    """Runner A reads turn 1 as next; before it writes, runner B (another connection)
    takes turn 1. A must not take it as well: it moves on to turn 2."""
    h1, h2 = History(tmp_path / "h.db"), History(tmp_path / "h.db")
    b = TurnStore(h2)
    first, second = queue(b, 2)
    taken_by_b = []

    def b_first(turn_id):
        if not taken_by_b:
            taken_by_b.append(b.claim(URL, "B"))

    a = TurnStore(h1, claim_hook=b_first)
    got = a.claim(URL, "A")
    assert taken_by_b[0].id == first.id
    assert got.id == second.id
    assert a.get(first.id).runner == "B" and a.get(second.id).runner == "A"


def test_only_the_lock_holder_adopts_a_running_turn(store):
    (t,) = queue(store, 1)
    store.claim(URL, "dead-runner")
    assert store.claim(URL, "other") is None                 # not without the lock
    adopted = store.claim(URL, "new-runner", adopt=True)
    assert adopted.id == t.id and adopted.runner == "new-runner"


def test_progress_ids_and_end_are_kept(store):
    (t,) = queue(store, 1)
    t = store.claim(URL, "r")
    store.save_progress(t, reasoning="think", content="Hi", token_ids=[5, 6, 7], tokens=3,
                        first_token=100.0)
    store.finish(t.id, "done", "stop")
    got = store.get(t.id)
    assert (got.state, got.reasoning, got.content, got.token_ids, got.tokens) == \
        ("done", "think", "Hi", [5, 6, 7], 3)
    assert store.history.messages(t.conversation_id)[-1].status == "done"


def test_earlier_replies_are_sent_with_their_ids(store):
    first, second = queue(store, 2)
    t = store.claim(URL, "r")
    store.save_progress(t, reasoning="r", content="one", token_ids=[1, 2], tokens=2,
                        first_token=None)
    store.finish(t.id, "done", "stop")
    sent = store.request_messages(store.get(second.id))
    assert sent == [{"role": "user", "content": "prompt 0"},
                    {"role": "assistant", "content": "one", "reasoning_content": "r",
                     "k3_token_ids": [1, 2]},
                    {"role": "user", "content": "prompt 1"}]


def test_stop_a_queued_turn_at_once_a_running_one_by_request(store):
    a, b = queue(store, 2)
    store.claim(URL, "r")
    assert store.request_stop(b.id).state == "stopped"
    assert store.request_stop(a.id).state == "running"
    assert store.stop_is_requested(a.id)


def test_a_running_turn_is_not_marked_interrupted_when_another_process_opens_the_store(
        tmp_path):
    """Every `k3tui answers` opens the history; that must not end a turn a runner holds."""
    h = History(tmp_path / "h.db")
    s = TurnStore(h)
    (t,) = queue(s, 1)
    s.claim(URL, "r")
    plain = h.new_conversation()
    old = h.add_message(plain, "assistant", "cut", status="streaming")
    again = History(tmp_path / "h.db")
    statuses = {m.id: m.status for c in (t.conversation_id, plain) for m in again.messages(c)}
    assert statuses[t.message_id] == "streaming"
    assert statuses[old] == "interrupted"


def test_a_version_1_history_gains_the_turns_and_keeps_its_messages(tmp_path):
    path = tmp_path / "h.db"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0] + "; PRAGMA user_version=1;")
    db.execute("INSERT INTO conversations(title, created, updated) VALUES ('old', 1, 1)")
    db.execute("INSERT INTO messages(conversation_id, role, content, created) "
               "VALUES (1, 'user', 'kept', 1)")
    db.commit()
    db.close()
    h = History(path)
    assert h.schema_version == len(MIGRATIONS) == 2
    assert [m.content for m in h.messages(1)] == ["kept"]
    t = TurnStore(h).enqueue(1, "more", URL, {})
    assert t.state == "queued" and t.token_ids == []


def test_a_damaged_row_reads_as_no_ids_not_a_crash(store):
    (t,) = queue(store, 1)
    store.db.execute("UPDATE messages SET token_ids='[1, \"x\"]' WHERE id=?", (t.message_id,))
    store.db.execute("UPDATE turns SET settings='nope' WHERE id=?", (t.id,))
    got = store.get(t.id)
    assert got.token_ids == [] and got.settings == {}
