"""The seam every probe reads through: where /proc and /sys are, and which nvidia-smi to run.

Tests point it at captured trees (tests/k3tui/probe/data/...) and a recorded nvidia-smi; the
real machine uses the defaults.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import Callable

from engine.weights.sysmem import Roots


@dataclass
class ProbeEnv(Roots):
    """/proc and /sys (Roots), plus the helper commands the probe runs."""
    nvidia_smi: list[str] = field(default_factory=lambda: ["nvidia-smi"])
    systemd_run: list[str] = field(default_factory=lambda: ["systemd-run"])
    use_nvml: bool = True
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs
    timeout_s: float = 10.0

    def run(self, argv: list[str],
            timeout: float | None = None) -> subprocess.CompletedProcess | None:
        """Run a helper command; None when it is absent, hangs, or cannot start."""
        try:
            return subprocess.run(argv, capture_output=True, text=True,
                                  timeout=timeout or self.timeout_s, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None
