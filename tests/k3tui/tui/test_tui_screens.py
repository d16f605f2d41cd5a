"""Pilot tests of the other screens: conversations, downloads, packing, log, machine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
from textual.widgets import Input, OptionList
from tui_helpers import screen_text, settle, wait_until

from k3tui.history import History
from k3tui.paths import get_paths
import scenes
from k3tui.tui.screens.conversations import ConversationsScreen
from k3tui.tui.screens.jobs import JobsScreen, format_eta
from k3tui.tui.screens.machine import MachineScreen
from k3tui.tui.screens.startup import LogScreen
from scripted import ScriptedStream
from k3tui.tui.widgets.messages import UserMessage


async def test_tui_screens_conversations_open_rename_delete_export(app_factory, tmp_path):
    history = History(tmp_path / "h.db")
    first = history.new_conversation("first chat")
    history.add_message(first, "user", "old question")
    history.add_message(first, "assistant", "old answer", reasoning="old thoughts")
    second = history.new_conversation("second chat")
    history.add_message(second, "user", "new question")
    app = app_factory(ScriptedStream("x"), history=history)
    async with app.run_test() as pilot:
        await pilot.pause()
        assert [u.text for u in app.chat.query(UserMessage)] == ["new question"]
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert isinstance(app.screen, ConversationsScreen)
        options = app.screen.query_one(OptionList)
        assert options.option_count == 2
        await pilot.press("down")           # the older conversation
        await pilot.press("x")              # export it
        exported = list((get_paths().root / "exports").glob("*.md"))
        assert len(exported) == 1
        text = exported[0].read_text()
        assert "old thoughts" in text and "old answer" in text
        await pilot.press("r")
        box = app.screen.query_one(Input)
        box.value = "renamed chat"
        await pilot.press("enter")
        await pilot.pause()
        assert {c.title for c in history.list_conversations()} == {"renamed chat", "second chat"}
        await pilot.press("enter")          # open it
        await pilot.pause()
        assert app.chat.conversation_id == first
        assert [u.text for u in app.chat.query(UserMessage)] == ["old question"]
        await pilot.press("ctrl+o")
        await pilot.pause()
        highlighted = app.screen._selected()
        await pilot.press("d")              # armed, not yet deleted
        assert history.get_conversation(highlighted) is not None
        await pilot.press("d")
        assert history.get_conversation(highlighted) is None
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.chat


async def test_tui_screens_downloads_and_packing_read_job_states(app_factory):
    app = app_factory(ScriptedStream("x"))
    with scenes.write_jobs(get_paths().jobs_dir):
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("f3")
            await pilot.pause()
            assert isinstance(app.screen, JobsScreen)
            text = screen_text(app)
            assert "running   536.40 / 1,560.90 GB  412.0 MB/s  ETA 41m27s" in text
            assert "30 done · 61 queued · 1 failed" in text
            assert "model-00032-of-00096.safetensors" in text  # an active file row
            assert "7.80 / 16.30 GB" in text
            assert "model-00020-of-00096" not in text           # done files get no row
            await pilot.press("escape", "f4")
            await pilot.pause()
            text = screen_text(app)
            assert "17.90 / 41.20 GB" in text and "layer 42 of 93" in text
            assert "905.0 MB/s" in text


async def test_tui_screens_stalled_and_empty_jobs(app_factory):
    app = app_factory(ScriptedStream("x"))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        assert "No download jobs yet" in screen_text(app)
    assert format_eta(400 * 3600) == "99h+" and format_eta(125) == "2m05s"


def _put_job(job_id: str, **fields) -> None:
    import json

    from k3tui import jobs

    state = jobs.new_state(job_id, "download", ["k3tui"], "/data/tiny")
    state.update({"status": "done", "message": "Done.", **fields})
    (jobs.jobs_dir() / f"{job_id}.json").write_text(json.dumps(state))


async def test_tui_screens_a_damaged_job_file_is_a_line_not_an_exit(app_factory):
    """One malformed field in a state file made the chat exit when F3 was pressed."""
    _put_job("download-1201-000000-good", started=2000.0)
    _put_job("download-1201-000000-pid", status="running", pid="12345")
    _put_job("download-1201-000000-null", status="running", started=None)
    (get_paths().jobs_dir / "download-1201-000000-junk.json").write_text("{")
    app = app_factory(ScriptedStream("x"))
    async with app.run_test(size=(100, 30)) as pilot:
        for key in ("f3", "escape", "f4"):
            await pilot.press(key)
            await pilot.pause()
            if key == "escape":
                continue
            assert isinstance(app.screen, JobsScreen)
            text = screen_text(app)
            for line in ("download-1201-000000-junk skipped: it is not JSON",
                         "download-1201-000000-null skipped: 'started' is not a time",
                         "download-1201-000000-pid skipped: 'pid' is not a process id"):
                assert f"damaged state file {line}" in text, text
        assert "No pack jobs yet" in text
        await pilot.press("escape", "f3")
        await pilot.pause()
        assert "done      0 / 0 B" in screen_text(app)  # the good one is shown


async def test_tui_screens_small_cancelled_and_finished_jobs_read_as_words(app_factory):
    """"cancelled0.1 / 0.2 GB", a 1 KB file as "0.0/0.0" GB, a finished 12-layer pack as
    "layer 11"."""
    _put_job("download-1201-000000-canc", status="cancelled", total_bytes=200_000_000,
             done_bytes=120_000_000,
             files=[{"name": "config.json", "size": 1_234, "done": 400,
                     "status": "downloading"}])
    _put_job("pack-1201-000000-done", kind="pack", total_bytes=41_200_000_000,
             done_bytes=41_200_000_000, layer=11, layers=12)
    app = app_factory(ScriptedStream("x"))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        text = screen_text(app)
        assert "cancelled 120.0 / 200.0 MB" in text, text
        assert "0.4 / 1.2 KB" in text, text
        await pilot.press("escape", "f4")
        await pilot.pause()
        text = screen_text(app)
        assert "done      41.20 / 41.20 GB  12 of 12 layers" in text, text
        assert "layer 11" not in text


async def test_tui_screens_backend_log_and_machine(app_factory, tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("listening on http://127.0.0.1:1\nmodel ready in 0.5 s\n")
    app = app_factory(ScriptedStream("x"))
    app.backend.log_path = str(log)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f5")
        await wait_until(pilot, lambda: "model ready" in screen_text(app))
        assert isinstance(app.screen, LogScreen)
        await pilot.press("escape", "f6")
        await pilot.pause()
        assert isinstance(app.screen, MachineScreen)
        await wait_until(pilot, lambda: "Backend:" in screen_text(app), timeout=30)
        assert "CPU" in screen_text(app)


async def test_tui_screens_startup_then_chat(app_factory):
    """A backend that starts: the start-up screen gives way to the chat, header updated."""
    started = []

    class Running:
        kind, model, base_url, pid, log_path = "bundled", "kimi-k3", "http://x", None, None

    def starter(on_progress):
        on_progress("loading the trunk")
        return Running()

    def on_started(running):
        started.append(running)
        app.backend.model = "started-model"

    app = app_factory(ScriptedStream("hi"), starter=starter, on_started=on_started)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.screen is app.chat and started)
        await pilot.pause()
        assert "started-model" in screen_text(app)
        await pilot.press(*"q", "enter")
        await settle(app, pilot)
        assert app.chat.current.content == "hi"


async def test_tui_screens_failed_start_keeps_the_last_log_line_in_view(app_factory):
    """The start fails after its log tail filled the view: the failure's three lines shrink
    the tail, and its newest line (the server's error) must stay on screen."""
    from k3tui.errors import K3Error

    shown = threading.Event()

    def starter(on_progress):
        logs = get_paths().logs_dir
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "engine-test.log").write_text(
            "".join(f"load step {i}\n" for i in range(60)) + "error: out of memory\n")
        on_progress("loading")                  # the screen finds the log now
        shown.wait(30)
        raise K3Error("The engine exited while loading.", "read the log below")

    app = app_factory(ScriptedStream("x"), starter=starter)
    async with app.run_test(size=(100, 30)) as pilot:
        try:
            await wait_until(pilot, lambda: "error: out of memory" in screen_text(app))
        finally:
            shown.set()
        await wait_until(pilot, lambda: "press r to retry" in screen_text(app))
        await wait_until(pilot, lambda: "error: out of memory" in screen_text(app))
        assert "load step 59" in screen_text(app)


async def test_tui_screens_dead_backend_while_idle_offers_restart(app_factory):
    alive = {"value": True}
    starts = []

    class Running:
        kind, model, base_url, pid, log_path = "bundled", "kimi-k3", "http://x", None, None

    def starter(on_progress):
        starts.append(1)
        alive["value"] = True
        return Running()

    app = app_factory(ScriptedStream("back again"), starter=starter,
                      backend_alive=lambda: alive["value"])
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.screen is app.chat and starts)
        await pilot.press(*"q", "enter")
        await settle(app, pilot)
        alive["value"] = False       # the engine was OOM-killed while we read
        app.chat.sample_now()
        await pilot.pause()
        assert any("backend process has stopped" in n.message for n in app._notifications)
        await pilot.press("ctrl+r")  # restarts the backend, then regenerates
        await wait_until(pilot, lambda: len(starts) == 2 and app.screen is app.chat)
        await settle(app, pilot)
        assert app.chat.current.content == "back again"
        assert len(app.history.messages(app.chat.conversation_id)) == 2


async def test_tui_screens_keys_help(app_factory):
    from k3tui.tui.screens.keys import KeysScreen

    app = app_factory(ScriptedStream("x"))
    async with app.run_test() as pilot:
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, KeysScreen)
        text = screen_text(app)
        assert "Ctrl+J" in text and "Esc" in text and "F6" in text
        from k3tui.tui.screens.keys import KEYS

        missing = [key for key, _ in KEYS if key and key not in text]
        assert missing == [], f"{missing} are below the 80x24 window: {text}"
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.chat


@pytest.mark.parametrize("notices", ["in its progress report", "only when it returns"])
async def test_tui_screens_quit_while_the_backend_starts_leaves_no_server(app_factory, notices):
    """Esc while the backend loads: the app quits without a traceback, and the server the
    start had launched (a real process here) is stopped, whether the start learns of the
    quit from its next progress report (as `wait_ready` does) or only returns after it."""
    launched: list[subprocess.Popen] = []
    go = threading.Event()

    class Running:
        kind, model, base_url, pid, log_path = "bundled", "kimi-k3", "http://x", None, None

        def __init__(self, proc):
            self.proc = proc

        def stop(self):
            self.proc.kill()

    def starter(on_progress):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        launched.append(proc)
        on_progress("loading the trunk")
        go.wait(30)
        if notices == "in its progress report":
            try:
                on_progress("still loading")
            except BaseException:
                proc.kill()
                raise
        return Running(proc)

    app = app_factory(ScriptedStream("x"), starter=starter)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: "loading the trunk" in screen_text(app))
        await pilot.press("escape")  # quit
        for _ in range(3000):  # the quit is under way before the start goes on
            if app.return_code is not None:
                break
            await asyncio.sleep(0.01)
        assert app.return_code is not None
        go.set()
    try:  # the loop must stay free while the start-up thread reports back: wait off it
        assert await asyncio.to_thread(launched[0].wait, 30) is not None
    finally:
        launched[0].kill()  # a failed run leaves no sleeper behind either



async def test_tui_screens_conversation_list_fits_wide_titles_and_narrow_windows(app_factory,
                                                                                 tmp_path):
    """A CJK title pushed the message count two cells right of the others', and at 80
    columns the date wrapped onto a line of its own; a long title now ends in an ellipsis."""
    from rich.cells import cell_len

    history = History(tmp_path / "h.db")
    for title in ("plain title", "日本語の会話について", "a very long title " * 6):
        cid = history.new_conversation(title)
        history.add_message(cid, "user", "q")
    app = app_factory(ScriptedStream("x"), history=history)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+o")
        await pilot.pause()
        lines = screen_text(app).splitlines()
    rows = [line for line in lines if " msgs" in line]
    assert len(rows) == 3, rows
    columns = {cell_len(row[:row.index("1 msgs")]) for row in rows}
    assert len(columns) == 1, rows               # the count starts in one column for all
    assert all(time.strftime("%Y-%m-%d") in row for row in rows), rows  # its date beside it
    assert any("…" in line and "a very long title" in line for line in lines), "\n".join(lines)


async def test_tui_screens_export_that_cannot_be_written_says_so(app_factory, tmp_path):
    history = History(tmp_path / "h.db")
    cid = history.new_conversation("chat")
    history.add_message(cid, "user", "q")
    (get_paths().root / "exports").write_text("a file where the folder should be")
    app = app_factory(ScriptedStream("x"), history=history)
    async with app.run_test() as pilot:
        await pilot.press("ctrl+o")
        await pilot.pause()
        await pilot.press("x")
        await pilot.pause()
        assert isinstance(app.screen, ConversationsScreen)  # still running, no traceback
        notes = [n.message for n in app._notifications]
    assert any(n.startswith("Could not export to ") and n.endswith("press x again.")
               for n in notes), notes


async def test_tui_screens_conversations_after_a_new_chat_enter_opens_the_newest(app_factory,
                                                                                tmp_path):
    """After Ctrl+N the new chat is not in the list yet, so nothing was highlighted and
    Enter did nothing until an arrow key was pressed."""
    history = History(tmp_path / "h.db")
    older = history.new_conversation("older chat")
    history.add_message(older, "user", "older question")
    newest = history.new_conversation("newest chat")
    history.add_message(newest, "user", "newest question")
    app = app_factory(ScriptedStream("x"), history=history)
    async with app.run_test() as pilot:
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert app.screen.query_one(OptionList).highlighted == 0
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.screen is app.chat
                         and app.chat.conversation_id == newest)
        assert [u.text for u in app.chat.query(UserMessage)] == ["newest question"]
