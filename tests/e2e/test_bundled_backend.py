"""The bundled backend: the real `python -m engine serve` as a child process, on a
synthesized small checkpoint (random weights, `--steer-demo` keeps the text readable)."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from engine.checkpoint.synth import synthesize
from k3tui.backends.events import BackendError, Finished, ReasoningDelta, TokenStats
from k3tui.backends.launch import launch, launch_engine
from k3tui.config import Config
from k3tui.errors import K3Error


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("ck") / "small", size="small")


async def test_ls_engine_starts_streams_k3_stats_and_stops(checkpoint, started):
    progress = []
    backend = launch_engine(checkpoint, steer_demo=True, on_progress=progress.append)
    started.append(backend)
    assert backend.kind == "bundled" and backend.base_url.startswith("http://127.0.0.1:")
    assert httpx.get(backend.base_url + "/health").status_code == 200
    # The engine chose its own port (--port 0) and k3tui took the URL from its line.
    log = backend.log_path.read_text()
    assert "--port 0" in log and f"listening on {backend.base_url}\n" in log
    assert not backend.base_url.endswith(":0")
    events = [e async for e in backend.chat([{"role": "user", "content": "hi"}],
                                            max_tokens=12)]
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    stats = [e for e in events if isinstance(e, TokenStats)]
    assert stats and {"s_per_token", "gb_read", "rss_gb"} <= set(stats[-1].k3)
    assert stats[-1].backend_ms is not None
    assert isinstance(events[-1], Finished)
    backend.stop()
    assert backend.process.returncode is not None


async def test_ls_launch_from_config_passes_memory_flags(checkpoint, started):
    cfg = Config()
    cfg.backend.kind, cfg.model.dir = "bundled", str(checkpoint)
    cfg.engine.preset, cfg.engine.trunk_gb, cfg.engine.cache_gb = "custom", 0.5, 0.25
    seen = []
    backend = launch(cfg, on_progress=seen.append)
    started.append(backend)
    assert "python -m engine serve" in seen[0].message
    argv = backend.command
    assert argv[argv.index("--trunk-gb") + 1] == "0.5"
    assert argv[argv.index("--cache-gb") + 1] == "0.25"
    assert backend.model == "kimi-k3"
    assert httpx.get(backend.base_url + "/v1/models").json()["data"][0]["id"] == "kimi-k3"


async def test_ls_engine_killed_mid_answer_becomes_backend_error(checkpoint, started):
    backend = launch_engine(checkpoint, steer_demo=True)
    started.append(backend)
    events = []
    async for ev in backend.chat([{"role": "user", "content": "go"}], max_tokens=2000):
        events.append(ev)
        if len(events) == 4:
            os.kill(backend.pid, signal.SIGKILL)
    assert isinstance(events[-1], BackendError)
    assert "SIGKILL" in events[-1].message and "listening on" in events[-1].log_tail


def test_ls_engine_load_failure_reports_its_log(tmp_path, started):
    (tmp_path / "empty").mkdir()
    with pytest.raises(K3Error) as exc:
        started.append(launch_engine(tmp_path / "empty"))
    assert "config.json" in exc.value.message and "exited with code" in exc.value.message


def test_ls_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(K3Error) as exc:
        launch_engine(tmp_path / "nowhere")
    assert "k3tui download" in exc.value.next_step


def test_ls_engine_key_goes_by_environment_not_argv(checkpoint, started):
    """The key is in no argv (every local user reads /proc/PID/cmdline), nor in the log,
    yet the engine enforces it."""
    from pathlib import Path

    from k3tui.backends.bundled import start_engine

    key = "k3-argv-secret-6f1d"
    backend = start_engine(checkpoint, api_key=key, args=["--steer-demo"])
    started.append(backend)
    assert key.encode() not in Path(f"/proc/{backend.pid}/cmdline").read_bytes()
    assert key not in " ".join(backend.command) and key not in backend.log_path.read_text()
    models = backend.base_url + "/v1/models"
    assert httpx.get(models).status_code == 401
    assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_ls_engine_without_key_ignores_an_inherited_one(checkpoint, started, monkeypatch):
    monkeypatch.setenv("K3_API_KEY", "left-over-from-the-shell")
    backend = launch_engine(checkpoint, steer_demo=True)  # loopback: k3tui sends no key
    started.append(backend)
    assert httpx.get(backend.base_url + "/v1/models").status_code == 200
