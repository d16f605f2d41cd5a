"""The disk's honest references for `bench stream`.

* `raw_sweep`: the device's O_DIRECT speed through the engine's own `ReadPool` into the
  engine's own buffers (`aligned_buffer`: 2 MiB hugepage-backed where the kernel allows),
  for the request sizes the engine issues and a few queue depths, at random aligned places
  in the checkpoint's files. The best of the sweep is the reference: a virtual disk can be
  limited by requests per second, so a too-small request or too-shallow queue would make
  the bound generous. Each configuration also records the CPU seconds its reads cost per GB.
  The reads land in one buffer faulted in before any timing and reused, as the engine's
  slots are: fresh memory would time the kernel zeroing and compacting pages (up to 2.5 CPU
  seconds per GB here), which a warm decode never pays.
* `DiskCounters`: the block device's own counters (`/proc/diskstats`: sectors read and the
  time it had I/O in flight) around a decode, to cross-check what the engine says it read
  and to report how busy the disk really was.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.core.directio import ALIGN, FileTable, Read, ReadPool, aligned_buffer, align_down

SWEEP_BYTES = 256 << 20  # per configuration: long enough to fill any queue, short to run


def raw_sweep(paths: list[Path], sizes: list[int], depths: list[int],
              rng: np.random.Generator, nbytes: int = SWEEP_BYTES) -> dict:
    """GB/s for each (request size, queue depth) and the best of them."""
    files = FileTable()
    opened = [files.get(p) for p in paths]
    weights = np.array([f.size for f in opened], dtype=np.float64)
    table = []
    sizes = [max(ALIGN, align_down(s)) for s in sizes]
    ring = 2 * max(depths)  # more buffers than reads in flight: none is read into twice at once
    arena = aligned_buffer(ring * max(sizes))
    arena[::ALIGN] = 0  # fault every page in now, outside the timing
    try:
        for depth in depths:
            pool = ReadPool(depth, reserve=0)
            try:
                for size in sizes:
                    n = max(depth, nbytes // size)
                    which = rng.choice(len(opened), size=n, p=weights / weights.sum())
                    reads = []
                    for k, fi in enumerate(which):
                        f = opened[fi]
                        top = max(0, align_down(f.size - size))
                        off = align_down(int(rng.integers(0, top + 1)))
                        need = min(size, f.size - off)
                        at = (k % ring) * size
                        reads.append(Read(f, off, arena[at:at + size], need))
                    t0, c0 = time.perf_counter(), time.process_time()
                    pool.submit(reads, (0,), chunk=size).wait()
                    secs = time.perf_counter() - t0
                    got = sum(r.need for r in reads)
                    # the CPU the reads themselves cost (syscalls, page pinning, wakeups),
                    # which a decode on few cores takes from its compute
                    cpu = time.process_time() - c0
                    table.append({"request_bytes": size, "queue_depth": depth,
                                  "gb_per_s": got / 1e9 / secs, "cpu_s_per_gb": cpu / (got / 1e9)})
            finally:
                pool.close()
    finally:
        files.close()
    best = max(table, key=lambda r: r["gb_per_s"])
    return {"raw_gb_per_s": best["gb_per_s"], "best": best, "sweep": table}


@dataclass
class DiskSample:
    bytes_read: int
    busy_ms: int
    t: float


class DiskCounters:
    """`/proc/diskstats` for the block device holding `path` (None where there is none,
    e.g. tmpfs or a container without the file)."""

    def __init__(self, path: Path):
        st = os.stat(path)
        self.key = (os.major(st.st_dev), os.minor(st.st_dev))
        self.ok = self.sample() is not None

    def sample(self) -> DiskSample | None:
        try:
            text = Path("/proc/diskstats").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            f = line.split()
            if len(f) >= 13 and (int(f[0]), int(f[1])) == self.key:
                # sectors read are 512-byte units; field 13 is ms with I/O in flight
                return DiskSample(int(f[5]) * 512, int(f[12]), time.perf_counter())
        return None

    @staticmethod
    def between(a: DiskSample | None, b: DiskSample | None) -> dict:
        if a is None or b is None or b.t <= a.t:
            return {"device_gb_per_s": None, "disk_busy_fraction": None, "device_gb": None}
        secs = b.t - a.t
        return {"device_gb": (b.bytes_read - a.bytes_read) / 1e9,
                "device_gb_per_s": (b.bytes_read - a.bytes_read) / 1e9 / secs,
                "disk_busy_fraction": min(1.0, (b.busy_ms - a.busy_ms) / 1000 / secs)}
