"""The seam every probe reads through: where /proc and /sys are, and which nvidia-smi to run.

Tests point it at captured trees (tests/foundation/data/...) and a recorded nvidia-smi; the
real machine uses the defaults.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class ProbeEnv:
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    nvidia_smi: list[str] = field(default_factory=lambda: ["nvidia-smi"])
    systemd_run: list[str] = field(default_factory=lambda: ["systemd-run"])
    use_nvml: bool = True
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs
    timeout_s: float = 10.0

    def host(self, path: str) -> Path:
        """Map an absolute host path (as written in mountinfo) into this env's trees."""
        for prefix, root in (("/proc", self.proc), ("/sys", self.sys)):
            if path == prefix or path.startswith(prefix + "/"):
                return root / path[len(prefix):].lstrip("/")
        return Path(path)

    def read(self, path: Path) -> str | None:
        """Text of a pseudo file, or None when it is missing or unreadable (EOPNOTSUPP etc.)."""
        try:
            return path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    def run(self, argv: list[str],
            timeout: float | None = None) -> subprocess.CompletedProcess | None:
        """Run a helper command; None when it is absent, hangs, or cannot start."""
        try:
            return subprocess.run(argv, capture_output=True, text=True,
                                  timeout=timeout or self.timeout_s, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None


def parse_int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


NO_LIMIT = 2**62  # cgroup values at or above this mean "unlimited" (v1 PAGE_COUNTER_MAX etc.)


def limit_or_none(text: str | None) -> int | None:
    """A cgroup limit file ("max", bytes, or a huge v1 number) as bytes, None = no limit."""
    if text is None or text.strip() in ("", "max", "-1"):
        return None
    value = parse_int(text)
    if value is None or value >= NO_LIMIT or value < 0:
        return None
    return value
