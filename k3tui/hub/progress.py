"""Byte-weighted download progress shared by the worker threads.

Bytes already on disk when the download starts (complete files, resumed prefixes) are
*initial* bytes: they count towards `done_bytes` but never towards the rate, so a resume
shows no fake burst. The rate is a windowed rate of the aggregate counter.

The totals and the count of files per status are kept as they change, and an event lists
only the files being worked on (and the first few that failed): a snapshot costs the same
for a listing of 100,000 files as for 4.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from itertools import islice
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0
WORKING = ("verifying", "downloading", "retrying")   # listed in every event
FAILED_LISTED = 8                                    # failed files listed by name, at most


@dataclass
class FileProgress:
    name: str
    size: int
    done: int = 0
    status: str = "pending"   # pending | verifying | downloading | retrying | done | failed
    initial: int = 0          # of `done`, bytes found on disk rather than fetched now

    def as_dict(self) -> dict:
        return {"name": self.name, "size": self.size, "done": self.done, "status": self.status}


@dataclass
class ProgressEvent:
    """One snapshot for a UI. Emitted at most `max_hz` times per second."""

    total_bytes: int
    done_bytes: int
    initial_bytes: int
    rate_bps: float
    eta_s: float | None
    stalled: bool
    retries: int
    files: list[dict] = field(default_factory=list)    # the files being worked on, then
    errors: list[str] = field(default_factory=list)   # the first FAILED_LISTED failed ones
    counts: dict[str, int] = field(default_factory=dict)   # files per status, all of them

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0


def file_counts(state: dict) -> dict[str, int]:
    """Files per status in a download job's state file (`file_counts`, from the events'
    `counts`); {} when it holds none or a damaged one."""
    counts = state.get("file_counts")
    ok = isinstance(counts, dict) and all(
        isinstance(k, str) and type(n) is int and n >= 0 for k, n in counts.items())
    return counts if ok else {}


class Progress:
    def __init__(self, files: list[tuple[str, int]], *, stall_after_s: float = 15.0,
                 clock=time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self.files = {name: FileProgress(name, size) for name, size in files}
        self.total = sum(f.size for f in self.files.values())
        self.done = 0                  # sum of min(done, size) over the files
        self.counts = Counter(f.status for f in self.files.values())
        self._working: dict[str, FileProgress] = {}   # status in WORKING
        self._failed: dict[str, FileProgress] = {}    # in the order they failed
        self.initial = 0
        self.received = 0              # bytes fetched in this run (drives the rate)
        self.retries = 0
        self.errors: deque[str] = deque(maxlen=5)
        self.stall_after_s = stall_after_s
        self._samples: deque[tuple[float, int]] = deque()
        self._last_byte = clock()

    def _count(self, f: FileProgress, n: int) -> None:
        """Under the lock: `n` more (or fewer) bytes of `f` are done."""
        before = min(f.done, f.size)
        f.done += n
        self.done += min(f.done, f.size) - before

    def initial_bytes(self, name: str, n: int) -> None:
        """Bytes found on disk (not fetched now): counted as done, never as rate."""
        with self._lock:
            f = self.files[name]
            self._count(f, n)
            f.initial += n
            self.initial += n
            self._last_byte = self._clock()

    def reset_file(self, name: str) -> None:
        """A file starts over (corrupt or replaced): its bytes leave the done count."""
        with self._lock:
            f = self.files[name]
            self.initial -= f.initial
            self._count(f, -f.done)
            f.initial = 0

    def add(self, name: str, n: int) -> None:
        with self._lock:
            self._count(self.files[name], n)
            self.received += n
            self._last_byte = self._clock()

    def status(self, name: str, status: str) -> None:
        with self._lock:
            f = self.files[name]
            # a file starting (or re-hashing) gets a grace period; a retry's reconnect does
            # not, or a hub that refuses every connection would never show as stalled
            if status in ("downloading", "verifying") and f.status not in ("downloading",
                                                                            "retrying"):
                self._last_byte = max(self._last_byte, self._clock() - 1.0)
            if status == f.status:
                return
            self.counts[f.status] -= 1
            self.counts[status] += 1
            if status not in WORKING:
                self._working.pop(name, None)
            elif name not in self._working:       # in the order they started
                self._working[name] = f
            if status == "failed":
                self._failed[name] = f
            else:
                self._failed.pop(name, None)
            f.status = status

    def error(self, text: str, retry: bool = True) -> None:
        with self._lock:
            self.errors.append(text)
            self.retries += retry

    def snapshot(self) -> ProgressEvent:
        now = self._clock()
        with self._lock:
            self._samples.append((now, self.received))
            while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
                self._samples.popleft()
            t0, b0 = self._samples[0]
            rate = (self.received - b0) / (now - t0) if now - t0 >= 0.5 else 0.0
            active = any(f.status != "verifying" for f in self._working.values())
            stalled = active and now - self._last_byte >= self.stall_after_s
            eta = (self.total - self.done) / rate if rate > 0 and not stalled else None
            listed = [*self._working.values(), *islice(self._failed.values(), FAILED_LISTED)]
            return ProgressEvent(self.total, self.done, self.initial, rate, eta, stalled,
                                 self.retries, [f.as_dict() for f in listed],
                                 list(self.errors), {k: n for k, n in self.counts.items() if n})


class Ticker:
    """Calls `emit(progress.snapshot())` at most `max_hz` times a second, plus once at stop."""

    def __init__(self, progress: Progress, emit, max_hz: float = 10.0):
        self.progress, self.emit, self.period = progress, emit, 1.0 / max_hz
        self._last = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        time.sleep(max(0.0, self._last + self.period - time.monotonic()))
        self._emit()

    def _emit(self) -> None:
        self._last = time.monotonic()
        self.emit(self.progress.snapshot())

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._emit()
