"""Copying an earlier message: Ctrl+Up / Ctrl+Down highlight one, Ctrl+Y / Ctrl+G copy it.

Pilot tests at 80×24 against the scripted stream. Copies are read back from the app's
clipboard (the run is headless, so that is the route taken); what reaches tmux's buffer is
read back from a real tmux in tests/e2e/test_tui_copy_pick_tmux.py.
"""

from __future__ import annotations

from tui_helpers import screen_text, settle, wait_until

from scripted import ScriptedStream
from k3tui.tui.widgets.messages import AssistantMessage, UserMessage
from k3tui.tui.widgets.prompt import Prompt

SIZE = (80, 24)
FIRST_CODE = "for i in range(3):\n    print(i)\n"
SECOND_CODE = "echo done\n"
# Each answer is taller than the chat area at 80×24, so an earlier one is out of view.
ANSWERS = [
    "First answer.\n\n```python\n" + FIRST_CODE + "```\n\nThen run:\n\n```sh\n"
    + SECOND_CODE + "```\n\n" + "\n\n".join(f"one {i}" for i in range(8)),
    "Second answer, no code.\n\n" + "\n\n".join(f"two {i}" for i in range(8)),
    "Third answer.\n\n```\nthird block\n```\n\n" + "\n\n".join(f"three {i}" for i in range(8)),
]
REASONING = ["I think about one.", "I think about two.", "I think about three."]
PROMPTS = ["first question", "second question\nover two lines", "third question"]


async def send(pilot, text: str) -> None:
    """Type a prompt (Ctrl+J for its newlines) and press Enter."""
    for i, line in enumerate(text.split("\n")):
        if i:
            await pilot.press("ctrl+j")
        await pilot.press(*line)
    await pilot.press("enter")


async def three_turns(app, pilot, stream: ScriptedStream) -> None:
    for prompt, answer, reasoning in zip(PROMPTS, ANSWERS, REASONING):
        stream.content, stream.reasoning = answer, reasoning
        await send(pilot, prompt)
        await settle(app, pilot)
    assert [a.content for a in app.chat.query(AssistantMessage)] == ANSWERS


def picked(app):
    """The highlighted widgets, by the class the stylesheet draws."""
    return [w for w in app.chat.query("#chat > .picked")]


def in_view(app, widget) -> bool:
    """The widget's first row (the highlight's titled line) is inside the chat's view."""
    view = app.chat.query_one("#chat").scrollable_content_region
    return view.y <= widget.region.y < view.bottom


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


async def press(pilot, *keys: str) -> None:
    for key in keys:
        await pilot.press(key)
        await pilot.pause()


async def test_copy_pick_earlier_answer_not_its_reasoning(app_factory):
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        await three_turns(app, pilot, stream)
        answers = list(app.chat.query(AssistantMessage))
        # the view is at the newest answer (each is taller than the view)
        await wait_until(pilot, lambda: not in_view(app, answers[1]))
        assert picked(app) == []
        # newest answer, its prompt, then the answer before: answer 2 of 3
        await press(pilot, "ctrl+up", "ctrl+up", "ctrl+up")
        assert picked(app) == [answers[1]]
        await wait_until(pilot, lambda: in_view(app, answers[1]))  # scrolled to it
        assert answers[1].styles.border_top[0] == "heavy"  # the highlight is drawn
        await wait_until(pilot, lambda: "answer 2 of 3 · ctrl+y copies" in screen_text(app))
        await pilot.press("ctrl+y")
        assert app.clipboard == ANSWERS[1]  # exactly the answer: no reasoning in it
        assert "I think" not in app.clipboard
        assert notes(app)[-1].startswith(f"Copied answer 2 of 3 ({len(ANSWERS[1])} chars) via")
        # still highlighted after copying: Ctrl+Y again copies the same message
        assert picked(app) == [answers[1]]


async def test_copy_pick_earlier_user_prompt(app_factory):
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        await three_turns(app, pilot, stream)
        users = list(app.chat.query(UserMessage))
        await press(pilot, *["ctrl+up"] * 4)  # a3, u3, a2, u2
        assert picked(app) == [users[1]]
        await wait_until(pilot, lambda: in_view(app, users[1]))
        await wait_until(pilot, lambda: "you · prompt 2 of 3" in screen_text(app))
        await pilot.press("ctrl+y")
        assert app.clipboard == "second question\nover two lines"
        assert notes(app)[-1].startswith("Copied prompt 2 of 3 (30 chars)")
        # Alt+Up works too (macOS takes Ctrl+Up), and the first message is as far as it goes
        await press(pilot, "alt+up", "alt+up", "alt+up", "alt+up")
        assert picked(app) == [users[0]]
        await pilot.press("ctrl+y")
        assert app.clipboard == "first question"
        # Ctrl+Down walks back; past the newest message the highlight ends at the prompt
        await press(pilot, *["ctrl+down"] * 5)
        assert picked(app) == [list(app.chat.query(AssistantMessage))[-1]]
        await press(pilot, "ctrl+down")
        assert picked(app) == []
        chat = app.chat.query_one("#chat")
        await wait_until(pilot, lambda: chat.scroll_y == chat.max_scroll_y)


async def test_copy_pick_code_blocks_of_an_earlier_answer(app_factory):
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        await three_turns(app, pilot, stream)
        await press(pilot, *["ctrl+up"] * 5)  # answer 1 of 3
        assert picked(app) == [list(app.chat.query(AssistantMessage))[0]]
        await pilot.press("ctrl+g")
        assert app.clipboard == SECOND_CODE  # the last block of that answer
        assert notes(app)[-1].startswith("Copied code block 2 of 2 from answer 1 of 3")
        assert notes(app)[-1].endswith("Ctrl+G again: block 1.")
        await pilot.press("ctrl+g")
        assert app.clipboard == FIRST_CODE  # again: the block before
        await pilot.press("ctrl+g")
        assert app.clipboard == SECOND_CODE  # and round again
        # A message without code says so and copies nothing.
        await press(pilot, "ctrl+down", "ctrl+down")  # prompt 2, answer 2
        await pilot.press("ctrl+g")
        assert notes(app)[-1] == "Answer 2 of 3 has no code block."
        assert app.clipboard == SECOND_CODE
        # Without a highlight, as before: the last answer and its last block.
        await press(pilot, "escape")
        assert picked(app) == []
        await pilot.press("ctrl+g")
        assert app.clipboard == "third block\n"
        await pilot.press("ctrl+y")
        assert app.clipboard == ANSWERS[2]


async def test_copy_pick_typing_and_escape_clear_the_highlight(app_factory):
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        await three_turns(app, pilot, stream)
        chat = app.chat.query_one("#chat")
        await press(pilot, "ctrl+up", "ctrl+up", "ctrl+up")
        assert len(picked(app)) == 1
        await press(pilot, "h", "i")  # typing in the prompt ends the highlight
        await wait_until(pilot, lambda: picked(app) == [])
        assert app.chat.query_one(Prompt).text == "hi"
        await wait_until(pilot, lambda: "answer 2 of 3 · ctrl+y" not in screen_text(app))
        await pilot.press("ctrl+y")
        assert app.clipboard == ANSWERS[2]  # back to the last answer
        await press(pilot, "ctrl+up", "ctrl+up", "ctrl+up")
        await wait_until(pilot, lambda: chat.scroll_y < chat.max_scroll_y)
        assert len(picked(app)) == 1
        await press(pilot, "escape")  # Esc ends it and goes back to the newest
        assert picked(app) == []
        await wait_until(pilot, lambda: chat.scroll_y == chat.max_scroll_y)
        assert app.chat.query_one(Prompt).text == "hi"  # the draft is untouched


async def test_copy_pick_regenerate_and_edit_drop_the_highlight(app_factory):
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        await three_turns(app, pilot, stream)
        chat = app.chat.query_one("#chat")
        await press(pilot, "ctrl+up")  # the newest answer, which Ctrl+R replaces
        assert len(picked(app)) == 1
        stream.content = "a fresh third answer"
        await pilot.press("ctrl+r")
        await settle(app, pilot)
        assert picked(app) == [] and not chat.held
        await wait_until(pilot, lambda: chat.scroll_y == chat.max_scroll_y)  # following
        await pilot.press("ctrl+y")
        assert app.clipboard == "a fresh third answer"
        await press(pilot, "ctrl+up", "ctrl+up")  # the last prompt, which Ctrl+E takes back
        await pilot.press("ctrl+e")
        await wait_until(pilot, lambda: app.chat.query_one(Prompt).text == "third question")
        await wait_until(pilot, lambda: picked(app) == [] and not chat.held)
        await pilot.press("ctrl+y")
        assert app.clipboard == ANSWERS[1]  # the last answer left


async def test_copy_pick_while_streaming_and_escape_still_stops(app_factory):
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        stream.content = ANSWERS[0]
        await send(pilot, "one")
        await settle(app, pilot)
        stream.content, stream.hang_after = "partial answer that hangs here", 3
        await send(pilot, "two")
        await wait_until(pilot, lambda: app.chat.current.content == "partial answer that")
        assert app.chat.generating
        await press(pilot, "ctrl+up", "ctrl+up", "ctrl+up")  # the streaming one, "two", one
        first = list(app.chat.query(AssistantMessage))[0]
        assert picked(app) == [first]
        await pilot.press("ctrl+y")
        assert app.clipboard == ANSWERS[0]
        assert app.chat.generating  # picking and copying do not touch the stream
        await pilot.press("escape")  # Esc stops the answer as always, and unhighlights
        await settle(app, pilot)
        assert not app.chat.generating and stream.closed == 2
        assert app.chat.current.status == "stopped"
        assert picked(app) == []


async def test_copy_pick_ctrl_t_toggles_the_highlighted_reasoning(app_factory):
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        await three_turns(app, pilot, stream)
        answers = list(app.chat.query(AssistantMessage))
        await press(pilot, "ctrl+up", "ctrl+up", "ctrl+up")
        await pilot.press("ctrl+t")
        assert not answers[1].reasoning_block.collapsed
        assert answers[2].reasoning_block.collapsed  # not the last answer's


async def test_pgup_pgdn_scroll_the_conversation_and_f1_says_so(app_factory):
    """PgUp/PgDn did nothing (the prompt has the focus and kept them); F1 did not say how
    to scroll."""
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        await three_turns(app, pilot, stream)
        chat = app.chat.query_one("#chat")
        await wait_until(pilot, lambda: chat.scroll_y == chat.max_scroll_y > 0)
        bottom = chat.max_scroll_y
        await pilot.press("pageup")
        await wait_until(pilot, lambda: chat.scroll_y < bottom)
        assert not chat.following               # reading up: a new answer will not yank it
        await pilot.press("pageup", "pagedown", "pagedown", "pagedown")
        await wait_until(pilot, lambda: chat.scroll_y == chat.max_scroll_y)
        assert chat.following
        await pilot.press("f1")
        await pilot.pause()
        assert "PgUp / PgDn" in screen_text(app) and "scroll the conversation" in \
            screen_text(app)


async def test_ctrl_y_after_an_answer_stopped_in_its_reasoning_copies_the_earlier_one(
        app_factory):
    """Esc during the reasoning leaves an answer with no text: Ctrl+Y said "No answer to
    copy yet" though the answer before it was on screen."""
    import asyncio

    from k3tui.backends.events import ReasoningDelta

    app = app_factory(ScriptedStream("The first answer."))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "one")
        await settle(app, pilot)

        def thinking(messages):
            async def gen():
                yield ReasoningDelta("thinking about it")
                await asyncio.Event().wait()   # until Esc cancels it
            return gen()

        app.stream = thinking
        await send(pilot, "two")
        await wait_until(pilot, lambda: "thinking" in (app.chat.current.reasoning or ""))
        await pilot.press("escape")
        await settle(app, pilot)
        await pilot.press("ctrl+y")
    assert app.clipboard == "The first answer."
    assert "Copied answer 1 of 2" in notes(app)[-1] and "stopped while reasoning" in \
        notes(app)[-1], notes(app)


async def test_the_view_follows_each_answer_to_its_end(app_factory):
    """The reasoning block collapsing when the answer starts asked (as Textual's Collapsible
    does) to be scrolled into view: the chat jumped back up to it and stopped following,
    so the end of the second answer was below the view. Ctrl+T still shows what it opens."""
    stream = ScriptedStream("")
    app = app_factory(stream)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat.query_one("#chat")
        for prompt, answer, reasoning in zip(PROMPTS, ANSWERS, REASONING):
            stream.content, stream.reasoning = answer, reasoning
            await send(pilot, prompt)
            await settle(app, pilot)
            await pilot.pause()  # the collapse's after-refresh scroll, and its animation
            await pilot.wait_for_scheduled_animations()
            await pilot.pause()
            assert chat.following and chat.scroll_y == chat.max_scroll_y, prompt
        last = list(app.chat.query(AssistantMessage))[-1]
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: not last.reasoning_block.collapsed
                         and in_view(app, last.reasoning_block))
