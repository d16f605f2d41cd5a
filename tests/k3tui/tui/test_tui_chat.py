"""Pilot tests of the chat screen against a scripted stream with a fake clock."""

from __future__ import annotations

import asyncio

from tui_helpers import K3, build_app, screen_text, settle, wait_until

from k3tui.backends.events import BackendError
from k3tui.history import History
from scripted import FakeClock, ScriptedStream
from k3tui.tui.widgets.messages import AssistantMessage, UserMessage
from k3tui.tui.widgets.prompt import Prompt

ANSWER = "Here is the code:\n\n```python\nprint('hi')\n```\n\nDone."


async def type_and_send(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")


async def test_tui_chat_streams_answer_and_collapses_reasoning(app_factory):
    stream = ScriptedStream(ANSWER, "First I think. Then I answer.", k3=K3)
    app = app_factory(stream)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "hello")
        await settle(app, pilot)
        answer = app.chat.query_one(AssistantMessage)
        assert answer.content == ANSWER
        assert answer.reasoning == "First I think. Then I answer."
        assert answer.reasoning_block.collapsed  # collapsed once the answer started
        await pilot.press("ctrl+t")
        assert not answer.reasoning_block.collapsed
        await pilot.press("ctrl+t")
        assert answer.reasoning_block.collapsed
        assert stream.requests == [[{"role": "user", "content": "hello"}]]
        msgs = app.history.messages(app.chat.conversation_id)
        assert [(m.role, m.status) for m in msgs] == [("user", "done"), ("assistant", "done")]
        assert msgs[1].reasoning.startswith("First I think")
        assert msgs[1].meta["tokens"] > 0
        text = screen_text(app)
        assert "print('hi')" in text and "Done." in text
        # Latency pane: fake clock → exact figures.
        assert "TTFT 250 ms    gen 25.0 tok/s" in text and "(client timing)" in text
        assert "read/token 2.4 GB" in text and "hit 62%" in text


async def test_tui_chat_reasoning_expanded_while_thinking(app_factory):
    stream = ScriptedStream("answer", "thinking hard about it", hang_after=None)
    stream.content = ""  # only reasoning so far
    stream.hang_after = None
    app = app_factory(stream)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "q")
        await settle(app, pilot)
        answer = app.chat.query_one(AssistantMessage)
        assert not answer.reasoning_block.collapsed


async def test_tui_chat_user_message_committed_before_request(tmp_path):
    seen = {}
    history = History(tmp_path / "h.db")

    def stream(messages):
        # At request time a second connection already sees the user's message.
        other = History(tmp_path / "h.db")
        seen["rows"] = [(m.role, m.content) for c in other.list_conversations()
                        for m in other.messages(c.id) if m.role == "user"]
        return ScriptedStream("ok", clock=FakeClock())(messages)

    app = build_app(tmp_path, stream, history=history)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "keep me")
        await settle(app, pilot)
    assert seen["rows"] == [("user", "keep me")]


async def test_tui_chat_escape_stops_and_keeps_partial(app_factory, tmp_path):
    stream = ScriptedStream("one two three four five six", hang_after=3)
    app = app_factory(stream)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "go")
        await wait_until(pilot, lambda: app.chat.current is not None
                         and app.chat.current.content.count(" ") >= 2)
        assert app.chat.generating
        await pilot.press("escape")
        await settle(app, pilot)
        assert not app.chat.generating
        assert stream.closed == 1  # the generator (and so the HTTP stream) was closed
        answer = app.chat.current
        assert answer.status == "stopped" and answer.content == "one two three"
        assert "stopped" in screen_text(app)
        msgs = app.history.messages(app.chat.conversation_id)
        assert (msgs[-1].status, msgs[-1].content) == ("stopped", "one two three")
    # Restart: the conversation, with the stopped answer, is still there.
    again = app_factory(ScriptedStream("x"), history=History(tmp_path / "history.sqlite3"))
    async with again.run_test() as pilot:
        await pilot.pause()
        assert [u.text for u in again.chat.query(UserMessage)] == ["go"]
        restored = again.chat.query_one(AssistantMessage)
        assert restored.status == "stopped" and restored.content == "one two three"


async def test_tui_chat_ctrl_j_newline_and_up_history(app_factory):
    app = app_factory(ScriptedStream("ok"))
    async with app.run_test() as pilot:
        prompt = app.chat.query_one(Prompt)
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb"
        await pilot.press("enter")
        await settle(app, pilot)
        assert prompt.text == ""
        await type_and_send(pilot, "second")
        await settle(app, pilot)
        await pilot.press("up")
        assert prompt.text == "second"
        await pilot.press("up")
        assert prompt.text == "a\nb"
        await pilot.press("down", "down")
        assert prompt.text == ""
        users = [m.content for m in app.history.messages(app.chat.conversation_id)
                 if m.role == "user"]
        assert users == ["a\nb", "second"]


async def test_tui_chat_regenerate_and_edit_last(app_factory):
    stream = ScriptedStream("first answer")
    app = app_factory(stream)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "question")
        await settle(app, pilot)
        stream.content = "second answer"
        await pilot.press("ctrl+r")
        await settle(app, pilot)
        answers = app.chat.query(AssistantMessage)
        assert [a.content for a in answers] == ["second answer"]
        assert stream.requests[1] == [{"role": "user", "content": "question"}]
        msgs = app.history.messages(app.chat.conversation_id)
        assert [(m.role, m.content) for m in msgs] == [("user", "question"),
                                                       ("assistant", "second answer")]
        await pilot.press("ctrl+e")
        await pilot.pause()
        assert app.chat.query_one(Prompt).text == "question"
        assert app.history.messages(app.chat.conversation_id) == []
        await pilot.press("end", *" again", "enter")
        await settle(app, pilot)
        assert stream.requests[-1] == [{"role": "user", "content": "question again"}]


async def test_tui_chat_an_error_retrying_cannot_fix_offers_the_edit_not_the_retry(app_factory):
    """A conversation over the backend's context fails the same way on ctrl+r: the popup
    must not offer it, and ctrl+e must bring the long message back to shorten."""
    err = BackendError("The backend reported an error: request (11131 tokens) exceeds the "
                       "available context size (8192 tokens).",
                       "edit the last message shorter (ctrl+e) or start a new chat (ctrl+n)",
                       retry=False)
    app = app_factory(ScriptedStream("", error=err))
    async with app.run_test() as pilot:
        await type_and_send(pilot, "a very long paste")
        await settle(app, pilot)
        note = next(n.message for n in app._notifications if "context size" in n.message)
        assert "ctrl+r" not in note and "Your history is saved." in note, note
        await pilot.press("ctrl+e")
        await pilot.pause()
        assert app.chat.query_one(Prompt).text == "a very long paste"


async def test_tui_chat_dead_backend_notifies_and_keeps_history(app_factory):
    err = BackendError("Could not connect to the backend at http://127.0.0.1:9.",
                       "start it with `k3tui serve`")
    stream = ScriptedStream("", error=err)
    app = app_factory(stream)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "anyone there?")
        await settle(app, pilot)
        notes = [n.message for n in app._notifications]
        assert any("Could not connect" in n and "ctrl+r to retry" in n for n in notes)
        assert app.chat.current.status == "error"
        msgs = app.history.messages(app.chat.conversation_id)
        assert msgs[0].content == "anyone there?"
        # Retry with a working backend: the failed answer is replaced.
        stream.error = None
        stream.content = "yes"
        await pilot.press("ctrl+r")
        await settle(app, pilot)
        assert [a.content for a in app.chat.query(AssistantMessage)] == ["yes"]


async def test_tui_chat_client_exception_is_a_notification(app_factory):
    def broken(messages):
        async def gen():
            raise ConnectionResetError("peer went away")
            yield  # pragma: no cover
        return gen()

    app = app_factory(broken)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "hi")
        await settle(app, pilot)
        assert app.chat.current.status == "error"
        assert any("peer went away" in n.message for n in app._notifications)


async def test_tui_chat_follows_only_near_bottom(app_factory):
    long = "\n\n".join(f"paragraph {i}" for i in range(60))
    stream = ScriptedStream(long, real_delay_s=0.01)
    app = app_factory(stream)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "long please")
        chat = app.chat.query_one("#chat")
        await wait_until(pilot, lambda: "paragraph 20" in (app.chat.current.content or ""))
        assert chat.scroll_y == chat.max_scroll_y > 0  # following the stream
        await pilot.press("shift+tab")  # leave the prompt, as a reader would
        chat.scroll_home(animate=False)  # the user scrolls up to read
        await settle(app, pilot)
        assert "paragraph 59" in app.chat.current.content
        assert chat.scroll_y < chat.max_scroll_y - 10  # not yanked to the bottom
        app.chat.query_one(Prompt).focus()
        await type_and_send(pilot, "next")  # sending jumps back and follows again
        await settle(app, pilot)
        assert chat.scroll_y == chat.max_scroll_y


async def test_tui_chat_copy_code_block(app_factory):
    app = app_factory(ScriptedStream(ANSWER))
    async with app.run_test() as pilot:
        await type_and_send(pilot, "code")
        await settle(app, pilot)
        await pilot.press("ctrl+g")
        assert app.clipboard == "print('hi')\n"
        await pilot.press("ctrl+y")
        assert app.clipboard == ANSWER


async def test_tui_chat_panes_refresh_at_most_4hz(app_factory):
    stream = ScriptedStream(" ".join(f"w{i}" for i in range(300)), real_delay_s=0.004)
    app = app_factory(stream)
    calls = []
    async with app.run_test() as pilot:
        pane = app.chat.query_one("#latency")
        original = pane.show
        pane.show = lambda snap: (calls.append(asyncio.get_running_loop().time()),
                                  original(snap))[1]
        await type_and_send(pilot, "go")
        await wait_until(pilot, lambda: not app.chat.generating, timeout=20)
    streamed = [t for t in calls[:-1]]  # the last one is the forced final refresh
    assert len(streamed) >= 2
    gaps = [b - a for a, b in zip(streamed, streamed[1:])]
    assert min(gaps) >= 0.2  # the 4 Hz timer, never per token


async def test_tui_chat_narrow_layout_and_resize(app_factory):
    app = app_factory(ScriptedStream("ok"))
    async with app.run_test(size=(80, 24)) as pilot:
        assert app.chat.has_class("narrow")
        side = app.chat.query_one("#side")
        assert side.region.height == 7 and side.region.width == 80
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert not app.chat.has_class("narrow")
        assert app.chat.query_one("#side").region.width == 40
        await pilot.press("f2")
        assert not app.chat.query_one("#side").display


async def test_tui_chat_streamed_fence_renders_as_code(app_factory):
    # Awkward chunks: the fence opener split across deltas, then more text after it.
    stream = ScriptedStream("Intro\n\n``` python\nx = 1\ny = 2\n```\nafter")
    app = app_factory(stream)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "fence")
        await settle(app, pilot)
        text = screen_text(app)
        assert "x = 1" in text and "y = 2" in text and "after" in text
        assert "```" not in text  # rendered as a code block, not as literal fences


async def test_tui_chat_long_answer_is_sealed_into_segments(app_factory):
    from k3tui.tui.bench import script_tokens
    from k3tui.tui.widgets.markdown import MarkdownSegment, StreamedMarkdown

    text = "".join(script_tokens(1200))
    app = app_factory(ScriptedStream(text))
    async with app.run_test() as pilot:
        await type_and_send(pilot, "long")
        await settle(app, pilot)
        md = app.chat.current.query_one(".answer-md", StreamedMarkdown)
        segments = list(md.query(MarkdownSegment))
        assert len(segments) >= 3  # old segments stop re-rendering
        assert "".join(s.source for s in segments) == text == md.source
        assert all(s.source.count("```") % 2 == 0 for s in segments[:-1])
        # Few widgets however long the answer: the layout stays cheap.
        assert len(list(app.chat.walk_children())) < 60


async def test_tui_chat_waits_for_a_loading_server_then_answers(tmp_path):
    from k3tui.backends.events import ContentDelta, Finished, Waiting

    ready = asyncio.Event()

    async def stream(messages):
        yield Waiting("the model is still loading; your prompt is sent when it is ready")
        await ready.wait()
        yield ContentDelta("Loaded and answering.")
        yield Finished("stop")

    app = build_app(tmp_path, stream)
    async with app.run_test() as pilot:
        await type_and_send(pilot, "hello")
        await wait_until(pilot, lambda: "still loading" in screen_text(app))
        answer = app.chat.query_one(AssistantMessage)
        assert answer.status == "streaming" and answer.content == ""
        ready.set()
        await wait_until(pilot, lambda: answer.status == "done")
        await settle(app, pilot)
        text = screen_text(app)
        assert "Loaded and answering." in text and "still loading" not in text
        msgs = app.history.messages(app.chat.conversation_id)
        assert (msgs[1].content, msgs[1].status) == ("Loaded and answering.", "done")
