"""Disk reads that never let the page cache grow: O_DIRECT into aligned buffers.

Every read the engine issues goes through a `ReadPool`: a few threads that call
`os.preadv` (the GIL is released during the syscall), so several requests are in flight
at once, the disk's queue never runs dry, and I/O overlaps the numpy compute.
Requests carry a priority (routed experts, which the compute is waiting for, before trunk
read-ahead) and are split into chunks so an urgent request never waits behind a whole
layer. Files that refuse O_DIRECT (tmpfs, some network filesystems) are read buffered and
the bytes just read are dropped from the page cache with `posix_fadvise(DONTNEED)`.

A `Layout` places a set of tensors (a trunk layer, one expert) in one buffer: tensors that
are adjacent on disk form one run, and each run is read as one 4096-aligned window.
"""

from __future__ import annotations

import heapq
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.errors import ReadError

ALIGN = 4096
CHUNK = 4 << 20  # a read-ahead chunk: what an urgent read may have to wait behind
HUGE = 2 << 20


def align_down(x: int, a: int = ALIGN) -> int:
    return x - (x % a)


def align_up(x: int, a: int = ALIGN) -> int:
    return -(-x // a) * a


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array from an anonymous mapping (RSS grows only when touched)."""
    size = max(ALIGN, align_up(nbytes))
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:  # fewer pages to pin per O_DIRECT read; purely an optimisation
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(mm, dtype=np.uint8)


class DirectFile:
    """One file opened O_DIRECT when the filesystem allows it, else buffered."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(self.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError as exc:
            if self.direct and exc.errno == 22:  # EINVAL: no O_DIRECT on this filesystem
                self.direct = False
                self.fd = self._open_buffered()
            else:
                raise ReadError(f"cannot open {self.path} ({exc.strerror}); check the path.") \
                    from None
        self.size = os.fstat(self.fd).st_size

    def _open_buffered(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise ReadError(f"cannot open {self.path} ({exc.strerror}); check the path.") from None
        # No kernel read-ahead: it would cache pages past the range we drop after reading.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def fall_back_to_buffered(self) -> None:
        old, self.fd, self.direct = self.fd, self._open_buffered(), False
        os.close(old)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_into(self, dest: np.ndarray, offset: int, need: int) -> int:
        """Read `dest.nbytes` bytes at aligned `offset`; at least `need` must arrive.

        Bytes past `need` may be cut short by the end of the file (an aligned window that
        reaches past EOF). Fewer than `need` bytes, or an OS error, is a `ReadError`.
        """
        done = 0
        total = dest.nbytes
        while done < need:
            try:
                n = os.preadv(self.fd, [dest[done:total].data], offset + done)
            except OSError as exc:
                if exc.errno == 22 and self.direct:  # EINVAL at read time: retry buffered
                    self.fall_back_to_buffered()
                    continue
                raise ReadError(
                    f"I/O error reading {self.path} at byte {offset + done} "
                    f"({exc.strerror}); the disk or file is damaged; check it and retry."
                ) from None
            if n == 0:
                raise ReadError(
                    f"short read: {self.path} ended at byte {offset + done} but "
                    f"{need - done} more bytes were expected there; the file is truncated or "
                    "changed; re-download or re-pack it."
                )
            done += n
        if not self.direct:
            # Drop what we read so the page cache never grows behind the budget's back.
            os.posix_fadvise(self.fd, offset, done, os.POSIX_FADV_DONTNEED)
        return done


class FileTable:
    """Opened files by path, shared by every reader of one source."""

    def __init__(self) -> None:
        self._files: dict[Path, DirectFile] = {}
        self._lock = threading.Lock()

    def get(self, path: Path) -> DirectFile:
        with self._lock:
            f = self._files.get(path)
            if f is None:
                f = self._files[path] = DirectFile(path)
            return f

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


@dataclass
class Read:
    """Read `dest` (aligned, whole) from `file` at aligned `offset`; `need` bytes must arrive."""

    file: DirectFile
    offset: int
    dest: np.ndarray
    need: int


class Batch:
    """A group of reads; `wait()` returns once all finished, or raises the first error."""

    def __init__(self, n_jobs: int, nbytes: int, then: Callable[[], None] | None = None):
        self._pending = n_jobs
        self._then = then  # run by the reader that finishes the last job, before `done`
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: ReadError | None = None
        self.cancelled = False
        self.started = False  # a job of it has begun reading (cancelling then loses bytes)
        self.nbytes = nbytes
        self.seq = 0  # when it was queued (the pool's sequence number of its first job)
        if n_jobs == 0:
            self._done.set()

    def _finish(self, error: ReadError | None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._pending -= 1
            last = self._pending == 0
        if not last:
            return
        if self._then is not None and self.error is None and not self.cancelled:
            try:  # e.g. a digest check: the bytes are not handed out unless it passes
                self._then()
            except ReadError as exc:
                self.error = exc
            except Exception as exc:  # never let a reader die silently
                self.error = ReadError(f"checking a read failed: {exc}")
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def finished(self) -> None:
        """Block until no job of this batch is queued or running (errors not raised)."""
        self._done.wait()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise ReadError("a read was cancelled before it finished; retry the request.")

    def cancel(self) -> None:
        """Skip the jobs not yet started; `finished()` then waits for the running ones."""
        self.cancelled = True


@dataclass(order=True)
class _Job:
    priority: tuple
    seq: int
    read: Read = field(compare=False)
    batch: Batch = field(compare=False)


class ReadPool:
    """`threads` workers issuing `os.preadv` concurrently (the queue depth of the disk).

    Two classes of work. Urgent reads (priority class 0: the compute is blocked on them)
    are taken first, by any idle worker. Background reads (read-ahead) may occupy at most
    `threads - reserve` workers, so an urgent read never waits for a whole queue of
    read-ahead chunks to drain: at worst for one chunk per reserved worker.
    """

    def __init__(self, threads: int = 4, chunk: int = CHUNK, reserve: int | None = None):
        self.threads = max(1, int(threads))
        self.chunk = max(ALIGN, align_down(chunk))
        # Half the workers stay free for urgent reads: read-ahead still keeps the disk's
        # queue full, and an urgent read shares the disk with fewer chunks already issued.
        self.reserve = min(self.threads - 1, self.threads // 2 if reserve is None else reserve)
        self._urgent: list[_Job] = []
        self._background: list[_Job] = []
        self._bg_running = 0
        self._cond = threading.Condition()
        self._closing = False
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._inflight = 0
        self._busy_since = 0.0
        self.busy_s = 0.0  # wall time with at least one read in flight
        self.bytes_read = 0  # bytes the device delivered (aligned windows)
        self._workers = [
            threading.Thread(target=self._work, name=f"k3-read-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for w in self._workers:
            w.start()

    def submit(self, reads: Iterable[Read], priority: tuple = (1,),
               chunk: int | None = None, then: Callable[[], None] | None = None) -> Batch:
        """Queue `reads` (in the given order, split into chunks) as one batch; `then()`
        runs on a reader once they all landed, and a ReadError from it fails the batch."""
        step = self.chunk if chunk is None else max(ALIGN, align_down(chunk))
        jobs: list[Read] = []
        nbytes = 0
        for r in reads:
            nbytes += r.dest.nbytes
            size = r.dest.nbytes
            for start in range(0, size, step):
                end = min(size, start + step)
                need = min(max(r.need - start, 0), end - start)
                jobs.append(Read(r.file, r.offset + start, r.dest[start:end], need))
        batch = Batch(len(jobs), nbytes, then)
        heap = self._urgent if priority[0] <= 0 else self._background
        with self._cond:
            batch.seq = next(self._seq)
            for job in jobs:
                heapq.heappush(heap, _Job(priority, next(self._seq), job, batch))
            self._cond.notify(len(jobs))
        return batch

    def _next(self) -> tuple[_Job | None, bool]:
        with self._cond:
            while True:
                if self._closing:
                    return None, False
                if self._urgent:
                    return heapq.heappop(self._urgent), False
                if self._background and self._bg_running < self.threads - self.reserve:
                    self._bg_running += 1
                    return heapq.heappop(self._background), True
                self._cond.wait()

    def _work(self) -> None:
        while True:
            job, background = self._next()
            if job is None:
                return
            try:
                self._run(job)
            finally:
                if background:
                    with self._cond:
                        self._bg_running -= 1
                        self._cond.notify()

    def _run(self, job: _Job) -> None:
        batch, read = job.batch, job.read
        if batch.cancelled:
            batch._finish(None)
            return
        batch.started = True
        self._enter()
        error = None
        try:
            if read.need > 0:  # chunks wholly past the payload are padding: skip
                read.file.read_into(read.dest, read.offset, read.need)
        except ReadError as exc:
            error = exc
        except Exception as exc:  # never let a worker die silently
            error = ReadError(f"read of {read.file.path} failed: {exc}")
        finally:
            self._leave(read.dest.nbytes if error is None else 0)
        batch._finish(error)

    def _enter(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1

    def _leave(self, nbytes: int) -> None:
        with self._lock:
            self._inflight -= 1
            self.bytes_read += nbytes
            if self._inflight == 0:
                self.busy_s += time.perf_counter() - self._busy_since

    def busy(self) -> bool:
        """Any read queued or running."""
        with self._cond:
            queued = bool(self._urgent or self._background)
        with self._lock:
            return queued or self._inflight > 0

    def close(self) -> None:
        with self._cond:
            self._closing = True
            left = self._urgent + self._background
            self._urgent, self._background = [], []
            self._cond.notify_all()
        for job in left:  # nobody may wait for ever on a read that will not happen
            job.batch._finish(ReadError("the reader was closed before this read ran."))
        for w in self._workers:
            w.join(timeout=10)


# ---- layouts -------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """Where a tensor's bytes live: a file, an absolute offset, a size, dtype and shape."""

    name: str
    file: Path
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def view_of(self, raw: np.ndarray) -> np.ndarray:
        """The tensor from its bytes (a compact trunk's spec returns its own matrix type)."""
        return raw.view(self.dtype).reshape(self.shape)


@dataclass(frozen=True)
class Run:
    """Contiguous bytes [start, end) of `file`, read as window [win, win+win_len) at `pos`."""

    file: Path
    start: int
    end: int
    pos: int  # offset of the aligned window in the buffer

    @property
    def win(self) -> int:
        return align_down(self.start)

    @property
    def win_len(self) -> int:
        return align_up(self.end) - self.win

    @property
    def payload_pos(self) -> int:
        return self.pos + (self.start - self.win)


class Layout:
    """A set of tensors placed in one aligned buffer, read as few aligned windows."""

    def __init__(self, specs: Sequence[TensorSpec]):
        ordered = sorted(specs, key=lambda s: (str(s.file), s.offset))
        runs: list[list] = []  # [file, start, end, [specs]]
        for s in ordered:
            last = runs[-1] if runs else None
            if last is not None and last[0] == s.file and s.offset == last[2]:
                last[2] = s.offset + s.nbytes
                last[3].append(s)
            else:
                runs.append([s.file, s.offset, s.offset + s.nbytes, [s]])
        self.runs: list[Run] = []
        self.tensors: dict[str, tuple[int, TensorSpec]] = {}  # name → (buffer pos, spec)
        pos = 0
        for file, start, end, members in runs:
            run = Run(file, start, end, pos)
            self.runs.append(run)
            for s in members:
                self.tensors[s.name] = (run.payload_pos + s.offset - start, s)
            pos += run.win_len
        self.nbytes = pos  # buffer bytes needed (aligned windows)
        self.payload = sum(r.end - r.start for r in self.runs)  # bytes that matter

    def reads(self, files: FileTable, buf: np.ndarray) -> list[Read]:
        out = []
        for r in self.runs:
            f = files.get(r.file)
            # An aligned window may reach past EOF; only the payload must arrive.
            out.append(Read(f, r.win, buf[r.pos : r.pos + r.win_len], r.end - r.win))
        return out

    def views(self, buf: np.ndarray, strip: str = "") -> dict[str, np.ndarray]:
        """name (minus the `strip` prefix) → array view of `buf` in the tensor's dtype."""
        out = {}
        n = len(strip)
        for name, (pos, s) in self.tensors.items():
            key = name[n:] if n and name.startswith(strip) else name
            out[key] = s.view_of(buf[pos : pos + s.nbytes])
        return out
