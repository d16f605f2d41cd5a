"""SVG snapshots of the main screens at 80×24 and 120×40 (textual pinned to 8.2.8).

Update after an intended change: `python -m pytest tests/k3tui/tui/test_tui_snapshots.py
--snapshot-update`, then look at the report before committing.
"""

from __future__ import annotations

import pytest
import textual

from k3tui.paths import get_paths
import scenes
from k3tui.tui.app import BackendInfo
from k3tui.tui.screens.jobs import JobsScreen

SIZES = [(80, 24), (120, 40)]


@pytest.fixture(autouse=True)
def _pinned(monkeypatch):
    assert textual.__version__ == "8.2.8", "snapshots are pinned to textual 8.2.8"
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("K3TUI_ASCII", raising=False)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tui_snapshot_chat_code_fence(snap_compare, tmp_path, size):
    app = scenes.chat_app(tmp_path)
    assert snap_compare(app, terminal_size=size, run_before=scenes.run_turn)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tui_snapshot_chat_cjk_emoji(snap_compare, tmp_path, size):
    app = scenes.chat_app(tmp_path, scenes.CJK_ANSWER, "")
    assert snap_compare(app, terminal_size=size,
                        run_before=lambda pilot: scenes.run_turn(pilot, "日本語で答えて 🙂"))


def test_tui_snapshot_reasoning_expanded(snap_compare, tmp_path):
    app = scenes.chat_app(tmp_path)
    assert snap_compare(app, terminal_size=(120, 40),
                        run_before=lambda pilot: scenes.run_turn(pilot, expand_reasoning=True))


def test_tui_snapshot_light_theme_ascii(snap_compare, tmp_path):
    app = scenes.chat_app(tmp_path, theme="textual-light", ascii=True,
                          backend=BackendInfo("llama-server", "Kimi-K3-Q2_K", "", None))
    assert snap_compare(app, terminal_size=(80, 24), run_before=scenes.run_turn)


@pytest.mark.parametrize("kind", ["download", "pack"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tui_snapshot_jobs(snap_compare, tmp_path, size, kind):
    app = scenes.chat_app(tmp_path)

    async def open_screen(pilot):
        await pilot.app.push_screen(JobsScreen(kind, refresh_hz=0))
        await pilot.pause()

    with scenes.write_jobs(get_paths().jobs_dir):
        assert snap_compare(app, terminal_size=size, run_before=open_screen)


def test_tui_snapshot_startup_error(snap_compare, tmp_path):
    app = scenes.chat_app(tmp_path)
    app.starter = scenes.StartupScene(fail=True, write_log=False)

    async def wait_start(pilot):
        await pilot.pause()
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=wait_start)
