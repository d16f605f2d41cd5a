"""`k3tui chat --demo`: a small random-weight Kimi-K3-architecture model on the bundled engine.

The checkpoint is synthesised once into `get_paths().demo_dir` by the engine's own
`python -m engine synth DIR --size demo` (a subprocess: the TUI never imports `engine`),
then served by `launch_engine` under a budget of about a third of the model, so the
engine really streams experts and the I/O pane has something to show. The server steers
the random weights to readable words and a think channel (`--steer-demo`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3tui.errors import K3Error
from k3tui.paths import get_paths
from k3tui.units import GB

DEMO_LABEL = "demo model — random weights, not Kimi-K3"
DEMO_SEED = 0
DEMO_MAX_TOKENS = 200  # random weights: a longer answer shows nothing more
COMPLETE = ".k3tui-demo-complete"


def model_dir() -> Path:
    return get_paths().demo_dir / "model"


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def budget_gb(folder: Path) -> float:
    """About a third of the weights: enough to run, small enough that experts stream."""
    return round(max(model_bytes(folder) / 3 / GB, 0.005), 4)


def ensure_model(on_progress: Callable[[str], None] | None = None) -> Path:
    """Synthesise the demo checkpoint once; a half-written one is never used."""
    target = model_dir()
    if (target / COMPLETE).is_file():
        return target
    staging = target.with_name("model.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    if on_progress:
        on_progress("synthesising the demo model (once; about 60 MB)…")
    argv = [sys.executable, "-m", "engine", "synth", str(staging), "--size", "demo",
            "--seed", str(DEMO_SEED)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if on_progress and line.strip():
            on_progress(f"synthesising the demo model: {line.strip()}")
    if proc.wait() != 0:
        shutil.rmtree(staging, ignore_errors=True)
        tail = "\n".join(lines[-5:])
        raise K3Error(f"Could not synthesise the demo model ({tail or 'no output'}).",
                      "check that the engine is installed (`python -m engine --help`) and "
                      f"that {staging.parent} is writable")
    (staging / COMPLETE).write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def start(on_progress: Callable[[Any], None] | None = None) -> Any:
    """Synthesise if needed, then start the engine on it (a RunningBackend)."""
    from k3tui.backends.launch import launch_engine

    folder = ensure_model(on_progress)
    return launch_engine(folder, budget_gb=budget_gb(folder), steer_demo=True,
                         on_progress=on_progress)


def demo_session(s: Any) -> Any:
    """Make `s`, a chat Session (see k3tui.commands.chat) that already carries the [chat]
    settings, start the demo backend. It keeps those settings, so a demo turn (and
    `--demo --smoke`) asks the engine exactly what a real turn asks; only the answer is
    capped at DEMO_MAX_TOKENS and the seed fixed."""
    s.info.kind = "bundled"
    s.info.model = "demo"
    folder = model_dir()
    if (folder / COMPLETE).is_file():
        s.info.budget_gb = budget_gb(folder)
    s.info.label = DEMO_LABEL

    def starter(on_progress: Callable[[Any], None] | None = None) -> Any:
        running = start(on_progress)
        s.info.budget_gb = budget_gb(model_dir())
        return running

    s.starter = starter
    kwargs = s.chat_kwargs
    s.chat_kwargs = {**kwargs,
                     "max_tokens": min(kwargs.get("max_tokens") or DEMO_MAX_TOKENS,
                                       DEMO_MAX_TOKENS),
                     "extra": {**kwargs.get("extra", {}), "seed": DEMO_SEED}}
    return s
