"""Shared helpers for the foundation tests: probe envs over the captured trees."""

from __future__ import annotations

import sys
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
