"""Byte-weighted download progress shared by the worker threads.

Bytes already on disk when the download starts (complete files, resumed prefixes) are
*initial* bytes: they count towards `done_bytes` but never towards the rate, so a resume
shows no fake burst. The rate is a windowed rate of the aggregate counter.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0


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
    files: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0


class Progress:
    def __init__(self, files: list[tuple[str, int]], *, stall_after_s: float = 15.0,
                 clock=time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self.files = {name: FileProgress(name, size) for name, size in files}
        self.initial = 0
        self.received = 0              # bytes fetched in this run (drives the rate)
        self.retries = 0
        self.errors: deque[str] = deque(maxlen=5)
        self.stall_after_s = stall_after_s
        self._samples: deque[tuple[float, int]] = deque()
        self._last_byte = clock()

    def initial_bytes(self, name: str, n: int) -> None:
        """Bytes found on disk (not fetched now): counted as done, never as rate."""
        with self._lock:
            f = self.files[name]
            f.done += n
            f.initial += n
            self.initial += n
            self._last_byte = self._clock()

    def reset_file(self, name: str) -> None:
        """A file starts over (corrupt or replaced): its bytes leave the done count."""
        with self._lock:
            f = self.files[name]
            self.initial -= f.initial
            f.done = f.initial = 0

    def add(self, name: str, n: int) -> None:
        with self._lock:
            self.files[name].done += n
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
            total = sum(f.size for f in self.files.values())
            done = sum(min(f.done, f.size) for f in self.files.values())
            active = any(f.status in ("downloading", "retrying") for f in self.files.values())
            stalled = active and now - self._last_byte >= self.stall_after_s
            eta = (total - done) / rate if rate > 0 and not stalled else None
            return ProgressEvent(total, done, self.initial, rate, eta, stalled, self.retries,
                                 [f.as_dict() for f in self.files.values()], list(self.errors))


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
