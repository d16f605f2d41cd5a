"""Memory facts: /proc/meminfo, the cgroup limit, and pressure (PSI) when the kernel has it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.weights.sysmem import CgroupInfo, memory_pressure_file, parse_meminfo
from k3tui.probe.env import ProbeEnv


@dataclass
class MemoryInfo:
    total_bytes: int = 0
    available_bytes: int = 0
    cached_bytes: int = 0
    swap_total_bytes: int = 0
    swap_free_bytes: int = 0
    cgroup_version: str = "none"
    cgroup_limit_bytes: int | None = None
    cgroup_current_bytes: int | None = None
    cgroup_swap_limit_bytes: int | None = None
    psi_some_avg10: float | None = None  # None = the kernel has no PSI (or it is off)
    psi_full_avg10: float | None = None

    @property
    def effective_total_bytes(self) -> int:
        """RAM this process may use at most: MemTotal clamped by the cgroup limit."""
        if self.cgroup_limit_bytes is not None:
            return min(self.total_bytes, self.cgroup_limit_bytes)
        return self.total_bytes

    @property
    def effective_available_bytes(self) -> int:
        """MemAvailable clamped by what the cgroup still allows (psutil reports host numbers)."""
        avail = self.available_bytes
        if self.cgroup_limit_bytes is not None:
            room = self.cgroup_limit_bytes - (self.cgroup_current_bytes or 0)
            avail = min(avail, max(0, room))
        return avail


def parse_psi(text: str | None) -> tuple[float | None, float | None]:
    """(some avg10, full avg10) from a pressure file; (None, None) when absent."""
    some = full = None
    for line in (text or "").splitlines():
        kind, *fields = line.split()
        values = dict(f.split("=", 1) for f in fields if "=" in f)
        try:
            avg = float(values["avg10"])
        except (KeyError, ValueError):
            continue
        if kind == "some":
            some = avg
        elif kind == "full":
            full = avg
    return some, full


def probe_memory(env: ProbeEnv, cg: CgroupInfo) -> MemoryInfo:
    mi = parse_meminfo(env.read(env.proc / "meminfo") or "")
    info = MemoryInfo(
        total_bytes=mi.get("MemTotal", 0),
        available_bytes=mi.get("MemAvailable", mi.get("MemFree", 0)),
        cached_bytes=mi.get("Cached", 0),
        swap_total_bytes=mi.get("SwapTotal", 0),
        swap_free_bytes=mi.get("SwapFree", 0),
        cgroup_version=cg.version,
        cgroup_limit_bytes=cg.memory_limit_bytes,
        cgroup_current_bytes=cg.memory_current_bytes,
        cgroup_swap_limit_bytes=cg.swap_limit_bytes,
    )
    # Machine-wide pressure first (other programs squeezing RAM matter); the cgroup's own
    # file only when the kernel exposes no system-wide one.
    text = env.read(env.proc / "pressure" / "memory")
    if text is None:
        own = memory_pressure_file(env, cg)
        text = env.read(own) if own else None
    info.psi_some_avg10, info.psi_full_avg10 = parse_psi(text)
    return info
