"""What tripped a new user up in the chat (issue 18): the popup's wording, the I/O pane's
labels, how an answer cut by quitting is recorded, and a chat that starts a new conversation."""

from __future__ import annotations

from tui_helpers import SAMPLES, screen_text, settle, wait_until

from k3tui.backends.events import BackendError
from k3tui.history import History
from k3tui.monitor import Sample
from scripted import FixedMonitor, ScriptedStream
from k3tui.tui.app import BackendInfo
from k3tui.tui.widgets.messages import AssistantMessage


async def test_connect_error_popup_reads_as_sentences(app_factory):
    err = BackendError("Could not connect to the backend at http://127.0.0.1:8099.",
                       "start it with `k3tui serve`, or check the URL in the config")
    app = app_factory(ScriptedStream("", error=err))
    async with app.run_test() as pilot:
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        note = next(n.message for n in app._notifications if "connect" in n.message)
    assert "8099.." not in note
    assert "http://127.0.0.1:8099. Start it with `k3tui serve`, or check the URL in the " \
           "config. Your history is saved" in note


def _io_lines(app) -> list[str]:
    return [line for line in screen_text(app).splitlines() if "MB/s" in line or "RSS" in line]


async def test_io_pane_calls_the_process_figure_backend_whoever_counts_it(app_factory):
    app = app_factory(ScriptedStream("one two three", hang_after=1),
                      monitor=FixedMonitor(SAMPLES))
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.chat
        chat.sample_now()                      # the kernel's per-process counter
        await pilot.pause()
        before = _io_lines(app)
        await pilot.press(*"hi", "enter")      # while an answer streams
        await wait_until(pilot, lambda: chat.current is not None and chat.current.content)
        chat.k3 = {"mb_per_s": 1340.0}         # the engine's own count
        chat.show_io()
        await pilot.pause()
        after = _io_lines(app)
        await pilot.press("escape")
    assert any("backend " in line for line in before), before
    assert any("backend 1340 MB/s" in line for line in after), after
    assert all("…" not in line for line in after), after   # whole in the side pane
    assert not any("engine " in line for line in before + after)


async def test_io_pane_drops_the_engines_rate_when_the_answer_ends(app_factory):
    """"backend 127 MB/s" stayed on screen 20 s after the answer: the engine's figure is its
    last token's, so once the answer ends the pane shows the sampled process rate. And
    "disk 684 MB/s" with nothing in flight was every disk of the machine, unsaid."""
    idle = Sample(t=0.0, disk_read_mb_s=684.0, proc_read_mb_s=0.0, proc_rss_gb=6.2)
    app = app_factory(ScriptedStream("one two three", k3={"mb_per_s": 127.0, "gb_read": 2.4}),
                      monitor=FixedMonitor([idle]))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        assert not app.chat.generating and app.chat.k3.get("mb_per_s") == 127.0
        app.chat.sample_now()
        await pilot.pause()
        lines = _io_lines(app)
    line = next(ln for ln in lines if "backend" in ln)
    assert "all disks 684 · backend 0 MB/s" in line and "127" not in line, lines


async def test_remote_io_pane_shows_no_rss(app_factory):
    app = app_factory(backend=BackendInfo("remote", "kimi-k3", url="https://x"),
                      monitor=FixedMonitor(SAMPLES))
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.chat
        chat.k3 = {"rss_gb": 6.2}   # a remote engine's stats, or a stale local sample
        chat.sample_now()
        await pilot.pause()
        text = screen_text(app)
    assert "remote: RSS not visible" in text
    rss_line = next(line for line in text.splitlines() if "RSS " in line and "cache" in line)
    assert "GB" not in rss_line.split("RSS ", 1)[1].split("cache")[0], rss_line


async def test_ctrl_q_mid_answer_is_recorded_as_stopped_by_quitting(app_factory, tmp_path):
    stream = ScriptedStream("one two three four five", hang_after=2)
    app = app_factory(stream)
    async with app.run_test() as pilot:
        await pilot.press(*"hi", "enter")
        await wait_until(pilot, lambda: app.chat.current is not None
                         and "two" in app.chat.current.content)
        await pilot.press("ctrl+q")
    msgs = History(tmp_path / "history.sqlite3").messages(1)
    assert msgs[-1].role == "assistant" and msgs[-1].status == "quit"
    # reopened, it says why the answer is partial
    again = app_factory(ScriptedStream("x"))
    async with again.run_test() as pilot:
        await pilot.pause()
        assert "stopped when k3tui quit" in screen_text(again)


async def test_esc_mid_answer_is_still_stopped_by_esc(app_factory):
    app = app_factory(ScriptedStream("one two three four five", hang_after=2))
    async with app.run_test() as pilot:
        await pilot.press(*"hi", "enter")
        await wait_until(pilot, lambda: app.chat.current is not None
                         and "two" in app.chat.current.content)
        await pilot.press("escape")
        await settle(app, pilot)
        assert app.chat.current.status == "stopped"
        assert "stopped (Esc)" in screen_text(app)


async def test_new_conversation_opens_empty_and_sends_no_old_turns(app_factory, tmp_path):
    history = History(tmp_path / "history.sqlite3")
    old = history.new_conversation("old")
    history.add_message(old, "user", "an old question")
    history.add_message(old, "assistant", "an old answer")
    stream = ScriptedStream("fresh")
    app = app_factory(stream, history=history, new_conversation=True)
    async with app.run_test() as pilot:
        await pilot.pause()
        assert not app.chat.query(AssistantMessage)
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        assert app.chat.conversation_id != old
    assert stream.requests == [[{"role": "user", "content": "hi"}]]


async def test_text_typed_while_the_backend_starts_waits_in_the_prompt(app_factory):
    import threading

    from k3tui.tui.screens.startup import StartupScreen
    from k3tui.tui.widgets.prompt import Prompt

    release, calls = threading.Event(), []

    def starter(on_progress):
        calls.append(1)
        release.wait(30)
        return object()

    app = app_factory(starter=starter)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StartupScreen))
        await pilot.press(*"hello rivers", "backspace")  # r is a letter here, not a retry
        await wait_until(pilot, lambda: "typed: hello river" in screen_text(app))
        release.set()
        await wait_until(pilot, lambda: app.screen is app.chat)
        assert app.chat.query_one(Prompt).text == "hello river"
    assert calls == [1]


async def test_failed_start_offers_the_demo_with_one_key(app_factory):
    from k3tui.errors import K3Error
    from k3tui.tui.screens.startup import StartupScreen

    def missing(on_progress):
        raise K3Error("The checkpoint folder /nope does not exist.", "run `k3tui download`")

    switched = []

    def demo():
        switched.append(1)
        return lambda on_progress: object()

    app = app_factory(starter=missing, demo=demo)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StartupScreen)
                         and "d to try the demo model" in screen_text(app))
        await pilot.press("d")
        await wait_until(pilot, lambda: app.screen is app.chat)
    assert switched == [1] and app.demo is None


async def test_a_tiny_terminal_keeps_the_chat_readable_and_f2_brings_the_panes_back(app_factory):
    """At 40x12 the panes under the chat left it one row; they hide there (F2 shows them)
    and come back by themselves once the window is tall enough."""
    app = app_factory(ScriptedStream("one two three four five six seven"))
    async with app.run_test(size=(40, 12)) as pilot:
        chat, side = app.chat.query_one("#chat"), app.chat.query_one("#side")
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        assert not side.display
        assert chat.region.height >= 6, chat.region
        assert "one two three" in screen_text(app)
        await pilot.resize_terminal(80, 24)     # tall enough again: the panes are back
        await pilot.pause()
        assert side.display and side.region.height == 7 and side.region.width == 80
        await pilot.resize_terminal(40, 12)
        await pilot.pause()
        assert not side.display
        await pilot.press("f2")                 # asked for: shown even here
        await pilot.pause()
        assert side.display and side.region.height == 7


async def test_an_empty_chat_says_what_to_do_until_the_first_message(app_factory):
    """The first run (and Ctrl+N) showed an empty screen above a box with no word in it."""
    app = app_factory(ScriptedStream("Hello."))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        hint = " ".join(screen_text(app).split())
        assert "Type a message below and press Enter to send" in hint
        assert "F1 lists every key" in hint
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        assert "Type a message below" not in screen_text(app)
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert "Type a message below" in screen_text(app)
        await pilot.press("ctrl+o")              # the old conversation: no hint over it
        await pilot.pause()
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.screen is app.chat and "Hello." in screen_text(app))
        assert "Type a message below" not in screen_text(app)
