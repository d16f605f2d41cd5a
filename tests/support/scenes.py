"""Scripted scenes of the real app, shared by the snapshot tests and `scripts/screenshots.py`.

Each scene builds a ChatApp around a scripted stream, a fake clock and fixed I/O samples,
so the same pixels come out on every run.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from k3tui.history import History
from k3tui.monitor import Sample
from k3tui.tui.app import BackendInfo, ChatApp
from scripted import FakeClock, FixedMonitor, ScriptedStream

REASONING = ("The user wants a function that reads one expert from disk. I should show "
             "O_DIRECT alignment and keep it short.")
CODE_ANSWER = """Read the expert's bytes with one aligned `pread`:

```python
def read_expert(fd: int, offset: int, nbytes: int) -> bytes:
    start = offset - offset % 4096           # O_DIRECT wants aligned offsets
    end = -(-(offset + nbytes) // 4096) * 4096
    buf = os.pread(fd, end - start, start)
    return buf[offset - start : offset - start + nbytes]
```

Each token reads **16 experts per layer**, so keep the reads large and aligned."""
CJK_ANSWER = """はい、日本語でも答えられます。🚀 中文也可以：模型在本地运行。

- 絵文字: ✨🧠💾 (幅 2 のセル)
- 한국어: 안녕하세요
- Ελληνικά και русский тоже.

幅の広い文字が混ざっても、表示は崩れません。"""

GAPS_MS = [1800, 1750, 2100, 1700, 5200, 1800, 1760, 1900, 1820, 1790, 2600, 1810]
K3 = {"s_per_token": None, "gb_read": 2.41, "mb_per_s": 1340.0, "true_hit_rate": 0.62,
      "rss_gb": 6.2, "budget_gb": 8.0}
SAMPLES = [Sample(t=float(i), disk_read_mb_s=v, proc_read_mb_s=v * 0.93, proc_rss_gb=6.2,
                  psi_some_avg10=1.5, psi_full_avg10=0.2, cgroup_current_gb=7.1,
                  cgroup_max_gb=12.0, page_cache_gb=3.4)
           for i, v in enumerate([120, 480, 950, 300, 1800, 640, 710, 90, 1200, 880, 400,
                                  1500, 1320, 1410, 260, 1380])]


def chat_app(home: Path, content: str = CODE_ANSWER, reasoning: str = REASONING, *,
             backend: BackendInfo | None = None, theme: str | None = None,
             ascii: bool = False) -> ChatApp:
    clock = FakeClock()
    stream = ScriptedStream(content, reasoning, clock=clock, gaps_ms=GAPS_MS, ttft_ms=9400,
                            k3=K3, backend_timings=True, prompt_tokens=412)
    return ChatApp(stream=stream, history=History(home / "history.sqlite3", clock=lambda: 0.0),
                   backend=backend or BackendInfo("bundled", "Kimi-K3", "laptop", 8.0),
                   monitor=FixedMonitor(SAMPLES), clock=clock, sample_hz=0, ascii=ascii,
                   theme=theme)


async def run_turn(pilot: Any, prompt: str = "Show me how to read one expert with O_DIRECT",
                   *, expand_reasoning: bool = False) -> None:
    """Type a prompt, let the scripted answer stream, fill the I/O sparkline."""
    from k3tui.tui.widgets.prompt import Prompt

    app = pilot.app
    chat = app.chat
    chat.query_one(Prompt).cursor_blink = False
    await pilot.pause()  # the prompt takes focus on mount
    await pilot.press(*prompt)
    await pilot.press("enter")
    await app.workers.wait_for_complete()
    for _ in range(len(SAMPLES)):
        chat.sample_now()
    if expand_reasoning:
        await pilot.press("ctrl+t")
    chat.refresh_panes(force=True)
    # Let layout, the anchored scroll (after a refresh) and the repaint settle.
    for _ in range(3):
        await pilot.pause(0.05)
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


@contextlib.contextmanager
def write_jobs(jobs_dir: Path) -> Iterator[None]:
    """A running download and a running pack, as the job processes write them. Each names a
    real stand-in process (a `sleep` carrying the job's id, as `start_job` starts a job), so
    `k3tui.jobs` finds it running; the stand-ins end with the block."""
    import psutil

    from k3tui.jobs import ENV_ID

    jobs_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    files = [{"name": f"model-{i:05d}-of-00096.safetensors", "size": 16_300_000_000,
              "done": 16_300_000_000 if i < 31 else (0 if i > 34 else 3_900_000_000 * (i - 30)),
              "status": "done" if i < 31 else ("pending" if i > 34 else "downloading")}
             for i in range(1, 97)]
    files[40]["status"] = "failed"
    counts = dict(collections.Counter(f["status"] for f in files))
    files = [f for f in files if f["status"] not in ("done", "pending")]   # as events list them
    common = {"status": "running", "updated": now}
    download = dict(common, id="dl-7f3a", kind="download", started=now - 3600,
                    message="moonshotai/Kimi-K3@main → /data/kimi-k3",
                    total_bytes=1_560_900_000_000, done_bytes=536_400_000_000,
                    rate_bps=412_000_000.0, eta_s=2487.0, stalled=False, files=files,
                    file_counts=counts)
    pack = dict(common, id="pk-19c2", kind="pack", started=now - 120,
                message="packing the trunk into /data/kimi-k3-trunk",
                total_bytes=41_200_000_000, done_bytes=17_900_000_000, rate_bps=905_000_000.0,
                eta_s=25.7, stalled=False, layer=41, layers=93)
    procs = []
    try:
        for state in (download, pack):
            argv = ["sleep", "3600"]
            proc = subprocess.Popen(argv, env=dict(os.environ, **{ENV_ID: state["id"]}))
            procs.append(proc)
            state.update(pid=proc.pid, pid_start=psutil.Process(proc.pid).create_time(),
                         argv=argv)
            (jobs_dir / f"{state['id']}.json").write_text(json.dumps(state))
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


class StartupScene:
    """A start-up that reports progress, then waits until `release` is set."""

    def __init__(self, fail: bool = False, write_log: bool = True) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.write_log = write_log  # the log's path is a temp dir: not in snapshots

    def __call__(self, on_progress: Any) -> Any:
        from k3tui.backends.running import LoadProgress
        from k3tui.errors import K3Error
        from k3tui.paths import get_paths

        logs = get_paths().logs_dir
        logs.mkdir(parents=True, exist_ok=True)
        if self.write_log:
            (logs / "engine-scene.log").write_text(
                "# k3tui: python -m engine serve /data/kimi-k3 --host 127.0.0.1 --port 41877 "
                "--preset laptop\n"
                "memory plan (budget 8.0 GB): weights 4.0 GB + fixed 2.1 GB = peak RSS 6.1 GB\n"
                "  trunk: 9 of 93 layers pinned (3.0 GB); streams 38.2 GB of trunk per token\n"
                "  experts: 1024 slots x 0.98 MB = 1.0 GB\n"
                "  reader threads: 8\n"
                "listening on http://127.0.0.1:41877\n"
                "loading: pinning trunk layers 0..8\n")

        on_progress(LoadProgress(0.0, message="bundled engine: python -m engine serve "
                                 "/data/kimi-k3 --preset laptop"))
        on_progress(LoadProgress(48.2, read_bytes=2_900_000_000, rss_bytes=3_100_000_000,
                                 total_bytes=1_560_900_000_000, message="pinning the trunk"))
        if self.fail:
            raise K3Error("The bundled engine exited with code 1 while loading.",
                          "read its log (below); `k3tui doctor` checks the model files")
        self.release.wait(30)
        raise K3Error("stopped", "")
