"""Small things a new user tripped on in the chat (issue 34): the F5 log's long lines, the
machine screen's units, what the demo's words are, and Ctrl+C."""

from __future__ import annotations

import re

from textual.widgets import Log
from tui_helpers import screen_text, settle, wait_until

from k3tui.config import Config, save_config
from scripted import ScriptedStream
from k3tui.tui.app import BackendInfo
from k3tui.tui.screens.machine import MachineScreen
from k3tui.tui.screens.startup import LogScreen


async def test_the_backend_log_says_the_arrows_reach_long_lines(app_factory, tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("short line\n" + "a-long-line " * 30 + "THE-END\n")
    app = app_factory(ScriptedStream("x"))
    app.backend.log_path = str(log)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f5")
        await wait_until(pilot, lambda: "short line" in screen_text(app))
        assert isinstance(app.screen, LogScreen)
        text = screen_text(app)
        assert "THE-END" not in text            # cut at the edge…
        assert "←/→ long lines" in text          # …and the screen says how to reach it
        view = app.screen.query_one(Log)
        await pilot.press("end", "right", "right", "right")
        await wait_until(pilot, lambda: view.scroll_x > 0)


async def test_the_machine_screen_speaks_of_memory_in_one_unit(app_factory):
    """"RAM 23.5 GiB total" above "21.5 GB usable of 25.3 GB RAM": two totals for one RAM.
    The bundled engine's presets are in GB, so its machine screen is in GB throughout."""
    cfg = Config()
    save_config(cfg)    # safetensors on the bundled engine (a GPU box would pick the GGUF)
    app = app_factory(ScriptedStream("x"))
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("f6")
        await wait_until(pilot, lambda: "Preset:" in screen_text(app), timeout=30)
        assert isinstance(app.screen, MachineScreen)
        text = screen_text(app)
    assert "GiB" not in text and "GB total" in text, text
    # this machine, named as `k3tui plan` names it, and the configured folder's disk
    assert "Machine: this machine (" in text and "Machine: probe" not in text, text


async def test_the_machine_screen_checks_the_configured_folder_and_shows_the_forecast(
        app_factory, tmp_path):
    from k3tui.planning import forecast

    cfg = Config()
    cfg.model.dir = str(tmp_path / "mine")
    save_config(cfg)
    forecast.store(forecast.Forecast(
        "2026-12-03 14:26", str(tmp_path), {}, [], {"sequential": 1.9, "experts": 1.8},
        [forecast.PresetForecast(n, True, 100.1, "disk", 5.3, 2520.0, 20880.0, 858.0, 1445.0)
         for n in ("laptop", "desktop", "workstation", "server", "max")]))
    app = app_factory(ScriptedStream("x"))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f6")
        await wait_until(pilot, lambda: "Preset:" in screen_text(app), timeout=30)
        text = " ".join(screen_text(app).split())
    assert str(tmp_path / "mine") in text, text
    assert re.search(r"Forecast: \w+ ~100 s/token", text) and "kimi-k3-in-c" not in text, text


async def test_the_demo_says_its_words_mean_nothing_by_design(app_factory):
    demo = BackendInfo("bundled", "demo", "demo", 0.021,
                       label="demo model — random weights, not Kimi-K3")
    app = app_factory(ScriptedStream("Emoji planted model summer."), backend=demo)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "meaningless by design" in " ".join(screen_text(app).split())
        await pilot.press(*"hi", "enter")
        await settle(app, pilot)
        notes = [n.message for n in app._notifications]
    assert any("meaningless by design" in n for n in notes), notes
    plain = app_factory(ScriptedStream("x"))           # not the demo: not said
    async with plain.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "meaningless" not in screen_text(plain)


async def test_ctrl_c_says_how_to_quit_and_copy(app_factory):
    app = app_factory(ScriptedStream("x"))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+c")
        await pilot.pause()
        notes = [(n.title, n.message) for n in app._notifications]
    assert notes and notes[-1][0] == "Ctrl+C does not quit here", notes
    assert "Ctrl+Q quits k3tui" in notes[-1][1] and "Ctrl+Y copies" in notes[-1][1]


async def test_choosing_the_demo_after_a_failed_start_says_so_in_the_empty_chat(app_factory):
    from k3tui.errors import K3Error
    from k3tui.tui.screens.startup import StartupScreen

    def missing(on_progress):
        raise K3Error("/tmp/walk/tiny has no tiktoken.model.", "fix it and start again")

    def demo():
        def start(on_progress):
            app.backend.label = "demo model — random weights, not Kimi-K3"  # as chat.py does
            return object()
        return start

    app = app_factory(starter=missing, demo=demo)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StartupScreen)
                         and "d to try the demo model" in screen_text(app))
        await pilot.press("d")
        await wait_until(pilot, lambda: app.screen is app.chat)
        await wait_until(pilot, lambda: "meaningless by design" in
                         " ".join(screen_text(app).split()))
