"""CPU facts: usable cores (affinity and cgroup quota), architecture, SIMD features."""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

from k3tui.probe.env import ProbeEnv


# Arm "CPU part" ids of cores k3tui is likely to meet (aarch64 /proc/cpuinfo has no model name).
ARM_PARTS = {"0xd85": "Cortex-X925", "0xd87": "Cortex-A725", "0xd4f": "Neoverse-V2",
             "0xd40": "Neoverse-V1", "0xd0c": "Neoverse-N1", "0xd8e": "Neoverse-N3"}


@dataclass
class CpuInfo:
    arch: str = ""
    model: str = ""
    online: int = 0  # cores the kernel runs
    allowed: int = 0  # this process's affinity mask
    quota_cores: float | None = None  # cgroup CPU quota, None = no quota
    usable: int = 1  # what to size threads by
    avx2: bool = False
    avx512: bool = False
    neon: bool = False


def parse_cpu_list(text: str | None) -> int:
    """Count CPUs in a list like "0-3,8,10-11"."""
    if not text:
        return 0
    n = 0
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            n += int(b) - int(a) + 1
        elif part.strip():
            n += 1
    return n


def probe_cpu(env: ProbeEnv, quota_cores: float | None = None) -> CpuInfo:
    info = CpuInfo()
    arch = (env.read(env.proc / "sys" / "kernel" / "arch") or "").strip()
    info.arch = arch or platform.machine()
    flags: set[str] = set()
    parts: list[str] = []
    for line in (env.read(env.proc / "cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key in ("model name", "cpu model") and not info.model:
            info.model = value.strip()
        elif key == "cpu part":
            name = ARM_PARTS.get(value.strip().lower(), value.strip())
            if name not in parts:
                parts.append(name)
    if not info.model and parts:
        info.model = " + ".join(parts)
    info.avx2 = "avx2" in flags
    info.avx512 = "avx512f" in flags
    # aarch64 always has Advanced SIMD; /proc/cpuinfo calls it "asimd".
    info.neon = "asimd" in flags or "neon" in flags or info.arch in ("aarch64", "arm64")
    info.online = parse_cpu_list(env.read(env.sys / "devices" / "system" / "cpu" / "online"))
    for line in (env.read(env.proc / "self" / "status") or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            info.allowed = parse_cpu_list(line.split(":", 1)[1])
    info.quota_cores = quota_cores
    usable = info.allowed or info.online or 1
    if quota_cores:
        usable = min(usable, max(1, math.ceil(quota_cores)))
    info.usable = usable
    return info
