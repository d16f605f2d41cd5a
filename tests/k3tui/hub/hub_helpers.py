"""Helpers shared by the download tests (imported as `hub_helpers`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

REPO_ID = "acme/tiny"
BIG = "model-00001-of-00002.safetensors"
SMALL = "model-00002-of-00002.safetensors"


def k3(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess with the test's environment."""
    p = subprocess.run([sys.executable, "-m", "k3tui", *args], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ), stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        raise AssertionError(f"k3tui {' '.join(args)} → {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def wait_for(pred, timeout: float = 30.0, every: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
