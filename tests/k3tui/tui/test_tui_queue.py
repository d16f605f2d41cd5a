"""Pilot tests of the chat's queue: prompts sent while an answer runs wait their turn.

The test plays the backend's runner on the real store (claim, progress, finish), so it
decides when each answer starts and ends; only the start of the runner's process is left
out (ensure_runner), since the test is that runner.
"""

from __future__ import annotations

import pytest
from tui_helpers import build_app, screen_text, wait_until

from k3tui.answers import runner
from k3tui.answers.store import TurnStore
from k3tui.history import History
from k3tui.tui.widgets.messages import AssistantMessage, UserMessage
from k3tui.tui.widgets.prompt import Prompt

BACKEND = "http://127.0.0.1:9/"


@pytest.fixture
def queued_app(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "ensure_runner", lambda backend, wait_s=None: None)

    def make(**kwargs):
        return build_app(tmp_path, queue=lambda: (BACKEND, {"max_tokens": 100}), **kwargs)
    return make


async def send(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")
    await pilot.pause()


def turns(app) -> list[tuple[int, str]]:
    return [(t.id, t.state) for t in TurnStore(app.history).list_turns()]


async def test_prompts_sent_while_answering_queue_and_run_in_order(queued_app):
    app = queued_app()
    store = TurnStore(app.history)
    async with app.run_test() as pilot:
        await send(pilot, "one")
        first = store.claim(BACKEND, "test")
        assert first is not None and first.id == 1
        await send(pilot, "two")
        await send(pilot, "three")
        assert turns(app) == [(1, "running"), (2, "queued"), (3, "queued")]
        users = list(app.chat.query(UserMessage))
        assert [(u.text, u.queued) for u in users] == [
            ("one", False), ("two", True), ("three", True)]
        assert "you · queued" in screen_text(app)

        store.save_progress(first, reasoning="", content="A1", token_ids=[], tokens=1,
                            first_token=None)
        store.finish(first.id, "done", "stop")
        await wait_until(pilot, lambda: not users[1].queued)   # the chat follows turn 2
        second = store.claim(BACKEND, "test")
        assert second is not None and second.id == 2
        # the request is the conversation up to the prompt, with the answer before it
        assert store.request_messages(second) == [
            {"role": "user", "content": "one"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "two"}]
        store.save_progress(second, reasoning="", content="A2", token_ids=[], tokens=1,
                            first_token=None)
        store.finish(second.id, "done", "stop")
        await wait_until(pilot, lambda: not users[2].queued)
        third = store.claim(BACKEND, "test")
        store.save_progress(third, reasoning="", content="A3", token_ids=[], tokens=1,
                            first_token=None)
        store.finish(third.id, "done", "stop")
        await wait_until(pilot, lambda: not app.chat.generating
                         and [a.content for a in app.chat.query(AssistantMessage)]
                         == ["A1", "A2", "A3"])
        # on screen, each answer follows its own prompt
        shown = [w.text if isinstance(w, UserMessage) else w.content
                 for w in app.chat.query("#chat > *") if isinstance(w, (UserMessage,
                                                                       AssistantMessage))]
        assert shown == ["one", "A1", "two", "A2", "three", "A3"]


async def test_esc_on_a_queued_prompt_takes_it_back_and_the_answer_goes_on(queued_app):
    app = queued_app()
    store = TurnStore(app.history)
    async with app.run_test() as pilot:
        await send(pilot, "one")
        first = store.claim(BACKEND, "test")
        await send(pilot, "two")
        await send(pilot, "three")
        await pilot.press("ctrl+up", "ctrl+up")          # the highlight on "two"
        assert app.chat.picked is not None and app.chat.picked.text == "two"
        assert "esc takes it back" in app.chat.picked.border_title
        await pilot.press("escape")
        await pilot.pause()
        assert turns(app) == [(1, "running"), (3, "queued")]   # its turn is gone with it
        assert not store.stop_is_requested(first.id)          # the running answer goes on
        assert app.chat.generating
        assert app.chat.query_one(Prompt).text == "two"        # back in the box to edit
        assert [u.text for u in app.chat.query(UserMessage)] == ["one", "three"]
        assert [m.content for m in app.history.messages(app.chat.conversation_id)
                if m.role == "user"] == ["one", "three"]

        store.save_progress(first, reasoning="", content="A1", token_ids=[], tokens=1,
                            first_token=None)
        store.finish(first.id, "done", "stop")
        await wait_until(pilot, lambda: app.chat.session.turn_id == 3)
        third = store.claim(BACKEND, "test")
        assert third is not None and third.id == 3
        assert [m["content"] for m in store.request_messages(third)] == ["one", "A1", "three"]


async def test_a_queued_prompt_that_started_meanwhile_is_not_taken_back(queued_app):
    app = queued_app()
    store = TurnStore(app.history)
    async with app.run_test() as pilot:
        await send(pilot, "one")
        first = store.claim(BACKEND, "test")
        await send(pilot, "two")
        await pilot.press("ctrl+up")
        store.finish(first.id, "done", "stop")
        assert store.claim(BACKEND, "test").id == 2   # the runner took it: the chat is late
        await pilot.press("escape")
        await pilot.pause()
        assert turns(app)[-1] == (2, "running")
        assert not store.stop_is_requested(2)
        assert "two" in [u.text for u in app.chat.query(UserMessage)]


async def test_a_chat_opened_on_queued_turns_follows_them_in_order(queued_app, tmp_path):
    """Turns queued from a shell (`k3tui ask`) behind a running one: the chat opened on
    them follows the running one live and shows the others queued under their prompts."""
    history = History(tmp_path / "history.sqlite3")
    store = TurnStore(history)
    conv = history.new_conversation("asked", backend="bundled", model="kimi-k3")
    for prompt in ("one", "two", "three"):
        store.enqueue(conv, prompt, BACKEND, {"max_tokens": 100})
    first = store.claim(BACKEND, "test")
    store.save_progress(first, reasoning="", content="A1 so far", token_ids=[], tokens=2,
                        first_token=None)
    app = queued_app(history=history, conversation_id=conv)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: [a.content for a in app.chat.query(AssistantMessage)]
                         == ["A1 so far"])
        assert app.chat.generating and app.chat.session.turn_id == first.id
        assert [(u.text, u.queued) for u in app.chat.query(UserMessage)] == [
            ("one", False), ("two", True), ("three", True)]
        store.finish(first.id, "done", "stop")
        await wait_until(pilot, lambda: app.chat.session.turn_id == 2)
        second = store.claim(BACKEND, "test")
        store.save_progress(second, reasoning="", content="A2", token_ids=[], tokens=1,
                            first_token=None)
        await wait_until(pilot, lambda: [a.content for a in app.chat.query(AssistantMessage)]
                         == ["A1 so far", "A2"])
        shown = [w.text if isinstance(w, UserMessage) else w.content
                 for w in app.chat.query("#chat > *")
                 if isinstance(w, (UserMessage, AssistantMessage))]
        assert shown == ["one", "A1 so far", "two", "A2", "three"]


async def test_the_status_line_shows_tokens_pace_and_time_left(queued_app, tmp_path):
    """The pace is the runner's (the store's Turn): 3 tokens, the first at t=1000 and the
    third at t=1018, is 9 s/token; 97 tokens left to max_tokens 100 is 873 s, ~15 min."""
    app = queued_app()
    now = [1000.0]
    store = TurnStore(app.history, clock=lambda: now[0])
    async with app.run_test() as pilot:
        await send(pilot, "one")
        turn = store.claim(BACKEND, "test")
        store.save_progress(turn, reasoning="", content="a", token_ids=[], tokens=1,
                            first_token=1000.0)
        answer = app.chat.query_one(AssistantMessage)
        line = answer.query_one(".status-line")
        await wait_until(pilot, lambda: str(line.render()) == "1 token")
        now[0] = 1018.0
        store.save_progress(turn, reasoning="", content="a b c", token_ids=[], tokens=3,
                            first_token=1000.0)
        await wait_until(pilot, lambda: "3 tokens" in str(line.render()))
        assert str(line.render()) == \
            "3 tokens · 9 s/token · at most ~15 min more (max_tokens 100)"
        store.finish(turn.id, "done", "stop")
        await wait_until(pilot, lambda: not app.chat.generating)
        assert not line.display        # a finished answer's line says how it ended, not pace


async def test_esc_stops_the_running_answer_and_the_chat_follows_the_next(queued_app):
    app = queued_app()
    store = TurnStore(app.history)
    async with app.run_test() as pilot:
        await send(pilot, "one")
        first = store.claim(BACKEND, "test")
        await send(pilot, "two")
        await pilot.press("escape")                     # nothing highlighted: the answer
        assert store.stop_is_requested(first.id)
        store.finish(first.id, "stopped", "stopped by request")   # the runner's part
        await wait_until(pilot, lambda: app.chat.session.turn_id == 2 and app.chat.generating)
        assert not [u for u in app.chat.query(UserMessage) if u.queued]
        assert turns(app) == [(1, "stopped"), (2, "queued")]
