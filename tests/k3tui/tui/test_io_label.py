"""The I/O pane says what bounds the backend's memory instead of "RSS x / budget", which
read as a tenfold overrun for the demo (its budget caps the weights, not the process)."""

from __future__ import annotations

import pytest
from tui_helpers import screen_text

from k3tui.tui.app import BackendInfo
from k3tui.tui.widgets.panes import IOPane


@pytest.mark.parametrize("backend,k3,title", [
    (BackendInfo("bundled", "demo", "demo", 0.021), {"rss_gb": 0.23, "budget_gb": 0.021},
     "I/O · streaming, weights ≤21 MB"),
    (BackendInfo("bundled", "kimi-k3", "max"), {"rss_gb": 230.0, "budget_gb": 0},
     "I/O · weights resident"),
    (BackendInfo("llama-server", "k3.gguf", budget_gb=96.7), {},
     "I/O · RSS limit 96.7 GB"),
    (BackendInfo("llama-server", "k3.gguf"), {}, "I/O · no memory limit"),
    (BackendInfo("remote", "kimi-k3", url="https://x"), {},
     "I/O · remote: RSS not visible"),
])
async def test_polish_io_pane_names_the_memory_bound(app_factory, backend, k3, title):
    app = app_factory(backend=backend, monitor=None)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.chat
        chat.k3 = dict(k3)
        chat.refresh_panes(force=True)
        await pilot.pause()
        pane = chat.query_one(IOPane)
        assert pane.border_title == title
        text = screen_text(app)
        assert title in text
        rss_line = next(line for line in text.splitlines() if "RSS " in line and "cache" in line)
        assert " / " not in rss_line.split("RSS ", 1)[1].split("cache")[0], rss_line
    header = backend.header().plain
    assert ("limit" in header) == (backend.kind == "llama-server" and bool(backend.budget_gb))


async def test_polish_io_pane_shows_the_pool_where_a_local_backend_shows_rss(app_factory):
    from k3tui.monitor import Sample

    app = app_factory(backend=BackendInfo("llama-server", "k3.gguf", budget_gb=21.2),
                      monitor=None)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.chat
        chat.last_sample = Sample(t=1.0, proc_rss_gb=0.03, pool=(
            ("10.0.0.2:50052", True, 144 * 2**20), ("10.0.0.3:50052", False, None)))
        chat.show_io()
        await pilot.pause()
        text = screen_text(app)
        assert "pool 1/2 up: 151·down MB" in text
        assert "RSS 30 MB" not in text  # the head's own RSS is not the model's memory here
