"""The bundled numpy engine as a child process: `python -m engine serve CHECKPOINT …`.

The TUI never imports `engine`; it talks to this process over HTTP like any backend, so an
engine crash cannot take the chat (or its history) down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from k3tui.backends.llama.server import wait_ready
from k3tui.backends.running import ProgressCallback, RunningBackend
from k3tui.errors import K3Error
from k3tui.paths import get_paths, private_open

if TYPE_CHECKING:
    from k3tui.config import EngineSection

ENGINE_ARGV = (sys.executable, "-m", "engine", "serve")


def memory_flags(engine_cfg: EngineSection) -> list[str]:
    """The config's [engine] section as `engine serve` memory flags."""
    args: list[str] = []
    preset = getattr(engine_cfg, "preset", "auto") or "auto"
    if preset == "custom":
        if not (engine_cfg.trunk_gb and engine_cfg.cache_gb):
            raise K3Error("The custom engine preset needs both engine.trunk_gb and "
                          "engine.cache_gb.", "set both with `k3tui config set engine.trunk_gb "
                          "GB` and `… engine.cache_gb GB`, or pick a named preset", 2)
        args += ["--trunk-gb", f"{engine_cfg.trunk_gb:g}",
                 "--cache-gb", f"{engine_cfg.cache_gb:g}"]
    else:
        args += ["--preset", preset]
    if getattr(engine_cfg, "threads", 0):
        args += ["--threads", str(engine_cfg.threads)]
    return args


def state_flags() -> list[str]:
    """Where the engine keeps conversation states on disk, so a restart resumes them, and
    how much it may keep there (the budget the plan shows)."""
    from k3tui.planning.states import STATE_GB

    return ["--state-dir", str(get_paths().states_dir), "--state-gb", f"{STATE_GB:g}"]


def start_engine(checkpoint: Path | str, *, args: Sequence[str] = (), host: str = "127.0.0.1",
                 port: int = 0, api_key: str | None = None, model_name: str | None = None,
                 on_progress: ProgressCallback | None = None,
                 engine_argv: Sequence[str] = ENGINE_ARGV,
                 load_timeout_s: float = 4 * 3600.0) -> RunningBackend:
    """Start the engine server, wait for "listening on …" and /health 200, with progress."""
    checkpoint = Path(checkpoint).expanduser()
    if not checkpoint.exists():
        raise K3Error(f"The checkpoint {checkpoint} does not exist.",
                      "run `k3tui download`, or set `dir` in [model] of the config")
    # With port 0 the engine binds a free port itself and names it in its "listening on"
    # line (no window in which another program could take a port chosen for it).
    argv = [*engine_argv, str(checkpoint), "--host", host, "--port", str(port)]
    if model_name:
        argv += ["--model-name", model_name]
    argv += list(args)
    logs = get_paths().logs_dir
    log_path = logs / f"engine-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{port}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the "listening" line must reach the log now
    # The key goes by the environment, which only its user can read (argv is in everyone's
    # `ps`); an inherited K3_API_KEY is dropped when k3tui sends none, or it would lock k3tui out.
    env.pop("K3_API_KEY", None)
    if api_key:
        env["K3_API_KEY"] = api_key
    with private_open(log_path) as log:
        log.write(("# k3tui: " + " ".join(argv) + "\n").encode())
        log.flush()
        try:  # same process group: a closed terminal stops the engine too (no orphans)
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            raise K3Error(f"Could not start the engine: {exc}.",
                          "check the Python environment (`python -m engine --help`)") from None
    view_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    backend = RunningBackend(kind="bundled", base_url=f"http://{view_host}:{port}",
                             api_key=api_key, model=model_name or "kimi-k3", pid=proc.pid,
                             log_path=log_path, command=argv, process=proc)
    try:
        wait_ready(backend, on_progress=on_progress, timeout_s=load_timeout_s,
                   ready_line="listening on", url_from_line=not port)
    except BaseException:
        backend.stop()
        raise
    return backend
