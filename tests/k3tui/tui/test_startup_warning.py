"""An unconfined llama-server is a risk the user must see while it loads: the start-up
screen shows the warning once (not in the progress line and again in the log tail) and
keeps it in view while later progress lines replace each other."""

from __future__ import annotations

import threading

import pytest
from tui_helpers import ScriptedStream, screen_text, wait_until

from k3tui.backends.running import LoadProgress
from k3tui.paths import get_paths

WARNING = ("WARNING: could not confine llama-server to 21.2 GiB (systemd-run is not "
           "installed). Risk: the kernel kills it.")


@pytest.fixture
def llama_cfg(tmp_path):
    """A config for llama-server with a real binary and a (header-only) GGUF."""
    from k3tui.backends.llama.binary import find_binary
    from k3tui.config import Config
    from k3tui.errors import K3Error

    gguf = pytest.importorskip("gguf")
    try:
        binary = find_binary("")
    except K3Error:
        pytest.skip("no llama-server binary here (the test extra installs one on x86-64)")
    model = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(model, arch="llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = Config()
    cfg.backend.kind, cfg.model.kind, cfg.model.dir = "llama-server", "gguf", str(model)
    cfg.llama_server.binary = str(binary)
    return cfg


async def test_polish_startup_shows_the_memory_warning_once(app_factory, llama_cfg,
                                                            monkeypatch):
    """The real `launch()` up to the process start; the server's start is replaced by one
    that logs like llama-server (k3tui's header, then many lines) and loads slowly."""
    from k3tui.backends import launch as launch_mod
    from k3tui.backends.llama import server
    from k3tui.backends.llama.server import MemoryLimit

    release, step = threading.Event(), threading.Event()
    moved_on = threading.Event()

    def slow_start(prepared, *, on_progress=None, **_):
        logs = get_paths().logs_dir
        logs.mkdir(parents=True, exist_ok=True)
        server_lines = "".join(f"srv load_model: tensor {i}\n" for i in range(80))
        (logs / "llama-server-test.log").write_text(
            f"# k3tui: {prepared.limit.describe()}\n# {prepared.command.shown()}\n"
            + server_lines)
        on_progress(LoadProgress(0.1))       # wait_ready reports at once, as the real one
        step.wait(30)
        on_progress(LoadProgress(2.5, read_bytes=1 << 20, rss_bytes=2 << 20))
        moved_on.set()
        release.wait(30)
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(server, "start", slow_start)
    unconfined = MemoryLimit("none", 1 << 30, detail=WARNING)
    app = app_factory(ScriptedStream("hi"),
                      starter=lambda p: launch_mod.launch(llama_cfg, on_progress=p,
                                                          limit=unconfined))
    async with app.run_test(size=(120, 40)) as pilot:
        try:
            await wait_until(pilot, lambda: "tensor 79" in screen_text(app), timeout=30)
            text = screen_text(app)
            assert text.count("could not confine") == 1, text     # not twice
            step.set()
            await wait_until(pilot, lambda: moved_on.is_set() and "2.5 s" in screen_text(app),
                             timeout=30)
            await pilot.pause(0.6)                                # a log reload or two
            text = screen_text(app)
            assert text.count("could not confine") == 1, text     # still in view, once
        finally:
            step.set()
            release.set()


def test_polish_launch_reports_the_warning_apart_from_the_description(llama_cfg):
    """The real launch path: a llama-server that cannot be confined reports the warning in
    `warnings`, and the description beside it leaves it out."""
    from k3tui.backends import launch as launch_mod
    from k3tui.backends.llama.server import MemoryLimit

    unconfined = MemoryLimit("none", 1 << 30, detail=WARNING)
    ready = launch_mod.prepare_launch(llama_cfg, limit=unconfined)
    assert ready.warnings[0] == WARNING
    assert "could not confine" not in ready.details and "command:" in ready.details
    assert "could not confine" in ready.describe()      # `k3tui serve` prints it all
