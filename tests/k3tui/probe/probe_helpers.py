"""Shared helpers for the foundation tests: probe envs over the captured trees."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from k3tui.probe.env import ProbeEnv

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
FAKE_SMI = HERE / "fake_nvidia_smi.py"


def smi(recording: str | None) -> list[str]:
    """The recorded nvidia-smi for `recording`; None = no nvidia-smi on this machine."""
    if recording is None:
        return [str(HERE / "no-such-dir" / "nvidia-smi")]
    return [sys.executable, str(FAKE_SMI), str(DATA / "nvidia-smi" / recording)]


def env_for(tree: str, gpu: str | None = None) -> ProbeEnv:
    return ProbeEnv(proc=DATA / tree / "proc", sys=DATA / tree / "sys", nvidia_smi=smi(gpu),
                    systemd_run=[str(HERE / "no-such-dir" / "systemd-run")], use_nvml=False,
                    timeout_s=10.0)


RMT_ENDPOINT = HERE.parent / "backends" / "fake_endpoint.py"


@contextlib.contextmanager
def fake_endpoint(tmp_path: Path, api_key: str) -> Iterator[tuple[int, Path]]:
    """The remote area's loopback OpenAI-compatible server: (port, its log file). It binds
    port 0 itself and prints the port it got, so no other program can take it meanwhile."""
    import re
    import subprocess
    import time

    log = tmp_path / "endpoint.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, str(RMT_ENDPOINT), "--port", "0",
                                 "--api-key", api_key], stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(rb"listening (\d+)", log.read_bytes())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield int(m.group(1)), log
    finally:
        proc.terminate()
        proc.wait(10)
