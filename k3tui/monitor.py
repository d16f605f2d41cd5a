"""Samples what the I/O pane shows, whichever backend runs. Core module: no UI imports.

One `Monitor.sample()` reads: the backend process's RSS and read bytes (psutil), the
system disk read counter, memory pressure (`/proc/pressure/memory`, PSI avg10), the
cgroup's `memory.current` / `memory.max` and the page-cache size (`Cached` in
`/proc/meminfo`). Rates come from deltas between two samples, so the caller decides the
pace (the TUI samples at 2 Hz). The clock and the /proc and /sys roots are injectable so
tests run against a fake tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3tui.units import GB, MB, KiB


@dataclass(frozen=True)
class Sample:
    t: float
    disk_read_mb_s: float | None = None      # whole system
    proc_read_mb_s: float | None = None      # the backend process
    proc_rss_gb: float | None = None
    psi_some_avg10: float | None = None      # % of time some task stalled on memory
    psi_full_avg10: float | None = None
    cgroup_current_gb: float | None = None
    cgroup_max_gb: float | None = None       # None = unlimited or unknown
    page_cache_gb: float | None = None
    # a pool's workers: (host:port, the head holds a connection to it, bytes it holds)
    pool: tuple[tuple[str, bool, int | None], ...] = ()


def _psutil_disk_read_bytes() -> int | None:
    import psutil

    try:
        counters = psutil.disk_io_counters()
    except (OSError, RuntimeError):
        return None
    return None if counters is None else int(counters.read_bytes)


def _whole_disks(sys_root: Path) -> set[str]:
    """Block devices that are not partitions (partitions would count the bytes twice)."""
    try:
        return {p.name for p in (sys_root / "block").iterdir()}
    except OSError:
        return set()


def diskstats_reader(proc_root: Path | str = "/proc", sys_root: Path | str = "/sys"):
    """A cheap `() -> read bytes` over /proc/diskstats (psutil re-checks every device
    in /sys on each call; the pane samples twice a second for hours)."""
    disks = _whole_disks(Path(sys_root))
    path = Path(proc_root) / "diskstats"

    def read() -> int | None:
        try:
            text = path.read_text()
        except OSError:
            return _psutil_disk_read_bytes()
        total = 0
        for line in text.splitlines():
            fields = line.split()
            if len(fields) > 5 and (not disks or fields[2] in disks):
                total += int(fields[5]) * 512  # sectors read; always 512-byte units
        return total

    return read


_processes: dict[int, object] = {}


def _psutil_process_stats(pid: int) -> tuple[int, int | None] | None:
    """(rss bytes, read bytes) of `pid`, or None when it is gone."""
    import psutil

    try:
        proc = _processes.get(pid)
        if proc is None:
            _processes.clear()
            proc = _processes[pid] = psutil.Process(pid)
        rss = int(proc.memory_info().rss)
        try:
            read = int(proc.io_counters().read_bytes)
        except (psutil.AccessDenied, AttributeError, OSError):
            read = None
        return rss, read
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return None


class Monitor:
    """Call `sample()` periodically; the first call has no rates yet (they need a delta)."""

    def __init__(self, pid: int | None = None, *, clock: Callable[[], float] = time.monotonic,
                 proc_root: Path | str = "/proc", sys_root: Path | str = "/sys",
                 disk_read_bytes: Callable[[], int | None] | None = None,
                 process_stats: Callable[[int], tuple[int, int | None] | None]
                 = _psutil_process_stats):
        self.pid = pid
        self._clock = clock
        self._proc = Path(proc_root)
        self._sys = Path(sys_root)
        self._disk_read_bytes = disk_read_bytes or diskstats_reader(proc_root, sys_root)
        self._process_stats = process_stats
        self._last: tuple[float, int | None, int | None] | None = None
        self._cgroup_dir: tuple[Path, str, str] | None | bool = False  # False: not looked up
        self.set_pool([], None)

    def set_pid(self, pid: int | None) -> None:
        """Follow another backend process (a restart); forget the old counters."""
        self.pid = pid
        self._last = None

    def set_pool(self, workers: list[str], log_path: str | None) -> None:
        """Follow a head's pool: which workers it is connected to, and what the load put
        on each (from its log)."""
        self._pool = list(workers)
        self._pool_log = log_path
        self._placed: dict[str, int] = {}

    def _pool_sample(self) -> tuple[tuple[str, bool, int | None], ...]:
        if not self._pool or self.pid is None:
            return ()
        from k3tui.backends.llama import rpc

        if not self._placed:
            self._placed = rpc.placement_in_log(self._pool_log)
        up = rpc.connected(self.pid, self._pool)
        return tuple((w, w in up, self._placed.get(w)) for w in self._pool)

    def sample(self) -> Sample:
        now = self._clock()
        disk = self._disk_read_bytes()
        rss = proc_read = None
        if self.pid is not None:
            stats = self._process_stats(self.pid)
            if stats is not None:
                rss, proc_read = stats
        disk_rate = proc_rate = None
        if self._last is not None:
            t0, disk0, read0 = self._last
            dt = now - t0
            if dt > 0:
                if disk is not None and disk0 is not None:
                    disk_rate = max(0.0, (disk - disk0) / dt / MB)
                if proc_read is not None and read0 is not None:
                    proc_rate = max(0.0, (proc_read - read0) / dt / MB)
        self._last = (now, disk, proc_read)
        some, full = self._psi()
        current, limit = self._cgroup_memory()
        return Sample(
            t=now, disk_read_mb_s=disk_rate, proc_read_mb_s=proc_rate,
            proc_rss_gb=None if rss is None else rss / GB,
            psi_some_avg10=some, psi_full_avg10=full,
            cgroup_current_gb=current, cgroup_max_gb=limit,
            page_cache_gb=self._page_cache_gb(), pool=self._pool_sample())

    # /proc and /sys readers; each returns None where the kernel does not offer the file.
    def _psi(self) -> tuple[float | None, float | None]:
        try:
            text = (self._proc / "pressure" / "memory").read_text()
        except OSError:
            return None, None
        values: dict[str, float] = {}
        for line in text.splitlines():
            kind, _, rest = line.partition(" ")
            for item in rest.split():
                key, _, value = item.partition("=")
                if key == "avg10":
                    try:
                        values[kind] = float(value)
                    except ValueError:
                        pass
        return values.get("some"), values.get("full")

    def _page_cache_gb(self) -> float | None:
        try:
            for line in (self._proc / "meminfo").read_text().splitlines():
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * KiB / GB
        except (OSError, ValueError, IndexError):
            pass
        return None

    def _find_cgroup_dir(self) -> tuple[Path, str, str] | None:
        """(folder, usage file, limit file) of this process's memory cgroup, v2 or v1.

        The backend is our child, so it shares our cgroup unless someone moved it.
        """
        try:
            lines = (self._proc / "self" / "cgroup").read_text().splitlines()
        except OSError:
            return None
        base = self._sys / "fs" / "cgroup"
        for line in lines:
            _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
            rel = rel.strip().lstrip("/")
            if "memory" in controllers.split(","):          # cgroup v1
                for candidate in (base / "memory" / rel, base / "memory"):
                    if (candidate / "memory.usage_in_bytes").exists():
                        return candidate, "memory.usage_in_bytes", "memory.limit_in_bytes"
        for line in lines:
            if line.startswith("0::"):                      # cgroup v2
                rel = line[3:].strip().lstrip("/")
                for candidate in (base / rel, base):
                    if (candidate / "memory.current").exists():
                        return candidate, "memory.current", "memory.max"
        return None

    def _cgroup_memory(self) -> tuple[float | None, float | None]:
        if self._cgroup_dir is False:
            self._cgroup_dir = self._find_cgroup_dir()
        found = self._cgroup_dir
        if not isinstance(found, tuple):
            return None, None
        folder, usage_name, limit_name = found
        try:
            current = int((folder / usage_name).read_text().split()[0]) / GB
        except (OSError, ValueError, IndexError):
            return None, None
        limit: float | None = None
        try:
            raw = (folder / limit_name).read_text().strip()
            # v2 says "max"; v1 says a number near 2**63 when unlimited.
            limit = None if raw == "max" or int(raw) >= 1 << 60 else int(raw) / GB
        except (OSError, ValueError):
            pass
        return current, limit
