"""Two chat windows on one history: each its own conversation unless asked, and a window
never sends turns it has not shown.

"Another window" here is a second connection to the same SQLite file (what another
process is to the store), a second session marking what it shows, or a real process
holding that mark until it is killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tui_helpers import REPO_ROOT, build_app, screen_text, settle

from k3tui.history import History
from scripted import ScriptedStream
from k3tui.tui.session import ChatSession
from k3tui.tui.widgets.prompt import Prompt


def _conversation(history: History, title: str, *turns: str) -> int:
    cid = history.new_conversation(title)
    for i, text in enumerate(turns):
        history.add_message(cid, "assistant" if i % 2 else "user", text)
    return cid


def test_a_second_window_opens_the_most_recent_conversation_no_window_shows(tmp_path):
    path = tmp_path / "h.sqlite3"
    older = _conversation(History(path), "older", "q0", "a0")
    newest = _conversation(History(path), "newest", "q1", "a1")
    first = ChatSession(History(path))
    assert first.first_free() == (newest, [])
    first.open(newest)
    second = ChatSession(History(path))
    chosen, passed = second.first_free()
    assert chosen == older and [c.id for c in passed] == [newest]
    second.open(older)
    third, passed = ChatSession(History(path)).first_free()
    assert third is None and [c.id for c in passed] == [newest, older]  # a new one
    first.close()  # the first window went away (or switched): its conversation is free
    assert ChatSession(History(path)).first_free()[0] == newest


def test_a_window_builds_its_request_from_what_it_shows(tmp_path):
    path = tmp_path / "h.sqlite3"
    cid = _conversation(History(path), "shared", "q1", "a1")
    mine, other = ChatSession(History(path)), ChatSession(History(path))
    mine.open(cid)
    other.open(cid)  # asked for by name: shared
    other.add_prompt("the other window's question", backend="b", model="m")
    answer = other.start_answer()
    other.history.update_message(answer, content="the other window's answer", status="done")
    assert mine.changed_elsewhere() and not ChatSession(History(path)).changed_elsewhere()
    mine.add_prompt("mine", backend="b", model="m")  # were it to send now: only its turns
    assert [m["content"] for m in mine.request_messages()] == ["q1", "a1", "mine"]


def test_a_window_killed_with_sigkill_frees_its_conversation_and_its_answer(tmp_path):
    """A real process shows a conversation with an answer streaming: another process
    opening the history neither takes that conversation nor marks the live answer
    interrupted; once the window is killed, both happen."""
    path = tmp_path / "h.sqlite3"
    cid = _conversation(History(path), "live", "q1")
    code = ("import sys; from k3tui.history import History; from k3tui.tui.session import "
            f"ChatSession; s = ChatSession(History({str(path)!r})); s.open({cid}); "
            "s.history.update_message(s.start_answer(), content='half an ans'); "
            "print('shown', flush=True); sys.stdin.read()")
    window = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert window.stdout.readline() == "shown\n"
        other = History(path)
        assert [m.status for m in other.messages(cid)] == ["done", "streaming"]
        assert ChatSession(other).first_free() == (None, other.list_conversations())
        os.kill(window.pid, signal.SIGKILL)
        window.wait(30)
        assert ChatSession(other).first_free()[0] == cid
        assert [m.status for m in History(path).messages(cid)] == ["done", "interrupted"]
    finally:
        window.kill()
        window.wait()


async def test_a_window_sends_nothing_another_window_added_until_it_has_shown_it(tmp_path):
    path = tmp_path / "h.sqlite3"
    cid = _conversation(History(path), "shared", "first question", "first answer")
    stream = ScriptedStream("Fine.")
    app = build_app(tmp_path, stream, history=History(path), conversation_id=cid)
    async with app.run_test() as pilot:
        await settle(app, pilot)
        other = History(path)  # another window on the same conversation adds a turn
        other.add_message(cid, "user", "the other window's question")
        other.add_message(cid, "assistant", "the other window's answer")
        await pilot.press(*"mine", "enter")
        await settle(app, pilot)
        assert stream.requests == []  # nothing went out with turns it never showed
        assert app.chat.query_one(Prompt).text == "mine"  # kept to send again
        assert "the other window's answer" in screen_text(app)
        assert any("changed in another k3tui window" in n.message for n in app._notifications)
        await pilot.press("enter")  # now it has shown them: they are its turns too
        await settle(app, pilot)
    assert [m["content"] for m in stream.requests[0]] == [
        "first question", "first answer", "the other window's question",
        "the other window's answer", "mine"]
    assert [m.content for m in History(path).messages(cid)][-2:] == ["mine", "Fine."]


async def test_regenerate_and_edit_act_only_on_turns_the_window_shows(tmp_path):
    path = tmp_path / "h.sqlite3"
    cid = _conversation(History(path), "shared", "q1", "a1")
    stream = ScriptedStream("again")
    app = build_app(tmp_path, stream, history=History(path), conversation_id=cid)
    async with app.run_test() as pilot:
        await settle(app, pilot)
        History(path).add_message(cid, "user", "added elsewhere")
        await pilot.press("ctrl+e")  # would have taken back the other window's prompt
        await settle(app, pilot)
        assert app.chat.query_one(Prompt).text == ""
        History(path).add_message(cid, "assistant", "answered elsewhere")
        await pilot.press("ctrl+r")  # would have dropped the other window's answer
        await settle(app, pilot)
        assert stream.requests == []
    assert [m.content for m in History(path).messages(cid)] == [
        "q1", "a1", "added elsewhere", "answered elsewhere"]


async def test_a_conversation_deleted_in_another_window_is_not_written_to(tmp_path):
    path = tmp_path / "h.sqlite3"
    cid = _conversation(History(path), "doomed", "q1", "a1")
    stream = ScriptedStream("new answer")
    app = build_app(tmp_path, stream, history=History(path), conversation_id=cid)
    async with app.run_test() as pilot:
        await settle(app, pilot)
        History(path).delete(cid)
        await pilot.press(*"still there?", "enter")
        await settle(app, pilot)
        assert stream.requests == [] and app.chat.conversation_id is None
        await pilot.press("enter")
        await settle(app, pilot)
    assert [m["content"] for m in stream.requests[0]] == ["still there?"]


async def test_a_chat_started_while_another_window_shows_the_newest_conversation(tmp_path):
    path = tmp_path / "h.sqlite3"
    cid = _conversation(History(path), "in the other window", "its question", "its answer")
    other = ChatSession(History(path))  # another window shows the newest conversation
    other.open(cid)
    stream = ScriptedStream("Hello.")
    app = build_app(tmp_path, stream, history=History(path))
    async with app.run_test() as pilot:
        await settle(app, pilot)
        assert "its answer" not in screen_text(app)
        assert any("open in another k3tui window" in n.message for n in app._notifications)
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        assert app.chat.conversation_id not in (None, cid)
    assert stream.requests == [[{"role": "user", "content": "hi"}]]
    assert [m.content for m in History(path).messages(cid)] == ["its question", "its answer"]
    other.close()
