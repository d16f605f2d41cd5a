"""A whole repo snapshot: plan (what is done, what remains, is there room), then a pool
of connections fetching byte ranges of files (`transfer.FileFetch`), reporting
`ProgressEvent`s."""

from __future__ import annotations

import contextlib
import shutil
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from k3tui.errors import K3Error
from k3tui.hub.progress import Progress, ProgressEvent, Ticker
from k3tui.hub.metadata import RemoteFile, RepoSnapshot, http
from k3tui.hub.store import LocalStore, UnsafeName, expected_digest, hash_file, new_hasher
from k3tui.hub.transfer import (
    Abandoned,
    Cancelled,
    CorruptAtHub,
    DiskFull,
    FileFailed,
    FileFetch,
    HubRefused,
    Options,
    is_disk_full,
)
from k3tui.units import GiB, MiB, transfer_size

def free_bytes(path: Path) -> int:
    """Free space of the filesystem that holds `path` (or its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def space_margin(need: int) -> int:
    """Room to leave free: 5% of what remains, at least 1 MB, at most 1 GiB."""
    return max(MiB, min(GiB, need // 20))


@dataclass
class DownloadPlan:
    snapshot: RepoSnapshot
    target: Path
    complete: list[str] = field(default_factory=list)       # recorded and unchanged
    to_check: list[str] = field(default_factory=list)       # on disk, not (re)verified yet
    partial: dict[str, int] = field(default_factory=dict)   # resumable bytes per file
    missing: list[str] = field(default_factory=list)
    free: int = 0
    update: str | None = None     # the folder holds another revision of this repo: the words

    @property
    def remaining_bytes(self) -> int:
        """Bytes still to fetch if every unchecked file on disk turns out fine."""
        sizes = {f.name: f.size for f in self.snapshot.files}
        return sum(sizes[n] - self.partial.get(n, 0) for n in self.missing)

    @property
    def margin(self) -> int:
        return space_margin(self.remaining_bytes)

    @property
    def short_of_space(self) -> bool:
        return self.remaining_bytes + self.margin > self.free

    def describe(self) -> str:
        s = self.snapshot
        lines = [f"{s.repo} @ {s.commit[:12]} ({s.revision}): {len(s.files)} files, "
                 f"{transfer_size(s.total_bytes)} → {self.target}",
                 f"  complete: {len(self.complete)}   to check: {len(self.to_check)}   "
                 f"partial: {len(self.partial)}   "
                 f"missing: {len(self.missing) - len(self.partial)}",  # partials are in missing
                 f"  to download: {transfer_size(self.remaining_bytes)}   "
                 f"free: {transfer_size(self.free)}"]
        if self.update:
            lines.append(f"  {self.update}")
        return "\n".join(lines)

    def refuse_if_short(self) -> None:
        if self.short_of_space:
            need = self.remaining_bytes + self.margin
            raise K3Error(
                f"Not enough space in {self.target}: {transfer_size(self.remaining_bytes)} "
                f"still to download plus a {transfer_size(self.margin)} margin, but only "
                f"{transfer_size(self.free)} free.",
                f"free {transfer_size(need - self.free)} or choose another --dir", 2)


CHECKS = ("size", "stat", "hash")


def plan_download(snapshot: RepoSnapshot, target: Path, *, check: str = "size",
                  store: LocalStore | None = None) -> DownloadPlan:
    """Sort files into complete / to check / partial / missing. K3Error when the folder
    holds another repo.

    `check`: "size" trusts a verification record whose size still matches; "stat" (used
    by --verify) also wants the same mtime, else the file is re-hashed; "hash" re-hashes
    every file on disk. A file on disk without a record is always hashed before use.
    """
    assert check in CHECKS
    store = store or LocalStore(target)
    plan = DownloadPlan(snapshot, Path(target), free=free_bytes(target),
                        update=store.check_origin(snapshot))
    with store.resolving_once():
        store.check_names(f.name for f in snapshot.files)   # one bad name refuses them all
        for rf in snapshot.files:
            final = store.final(rf.name)
            if check != "hash" and store.recorded_ok(rf, final, mtime=check == "stat"):
                plan.complete.append(rf.name)
            elif final.exists():
                plan.to_check.append(rf.name)
            else:
                plan.missing.append(rf.name)
                if have := store.resumable_bytes(rf):
                    plan.partial[rf.name] = have
    return plan


@dataclass
class DownloadResult:
    ok: bool
    cancelled: bool = False
    error: K3Error | None = None
    failed: list[str] = field(default_factory=list)
    verified_now: list[str] = field(default_factory=list)    # found on disk and checked
    replaced: list[str] = field(default_factory=list)        # found on disk, bad, refetched


def disk_full_error(target: Path, remaining: int, resume: str = "k3tui download") -> K3Error:
    """`resume`: the exact command that continues this download (the user's repo, --dir,
    --include…), shown so nobody has to reconstruct it from memory."""
    free = free_bytes(target)
    return K3Error(
        f"The disk holding {target} is full ({transfer_size(free)} free, "
        f"{transfer_size(remaining)} still to download); the partial files are kept.",
        f"free at least {transfer_size(remaining + space_margin(remaining) - free)} there, "
        "then rerun "
        f"`{resume}`: it resumes where it stopped (another --dir would start over)")


WORKERS = 8   # connections (see README: measured with `k3tui bench download`)


def download(snapshot: RepoSnapshot, target: Path, *, workers: int = WORKERS,
             opts: Options | None = None,
             on_progress: Callable[[ProgressEvent], None] | None = None,
             stop: threading.Event | None = None, check: str = "size",
             log: Callable[[str], None] = print, max_hz: float = 10.0,
             resume: str = "k3tui download") -> DownloadResult:
    """Bring `target` to exactly `snapshot`'s files (size + digest checked), resumably, over
    `workers` connections. `resume` is the command a disk-full error tells the user to rerun."""
    sync = Sync(snapshot, Path(target), opts=opts or Options.from_env(),
                stop=stop or threading.Event(), check=check, log=log, resume=resume)
    return sync.run(workers=workers, on_progress=on_progress, max_hz=max_hz)


class Sync:
    """One download: the plan, a queue of files, connection threads fetching their ranges
    (or checking the files already on disk), and the result they fill in under one lock.
    A free connection opens the next file while every open file has a connection (one
    connection per file reads in order, so its bytes are hashed as they land); once the
    queue is empty it joins the open file with the fewest connections, so the last files
    (or the only one) are fetched over all of them."""

    def __init__(self, snapshot: RepoSnapshot, target: Path, *, opts: Options,
                 stop: threading.Event, check: str, log: Callable[[str], None], resume: str):
        self.snapshot, self.target, self.opts, self.stop = snapshot, target, opts, stop
        self.log, self.resume = log, resume
        self.store = LocalStore(target)
        # checks every name and the repo the folder holds first
        self.plan = plan_download(snapshot, target, check=check, store=self.store)
        self.store.ensure()
        self.store.claim(snapshot)
        self.by_name = {f.name: f for f in snapshot.files}
        self.progress = Progress([(f.name, f.size) for f in snapshot.files],
                                 stall_after_s=max(10.0, opts.timeout_s / 2))
        for name in self.plan.complete:
            self.progress.initial_bytes(name, self.by_name[name].size)
            self.progress.status(name, "done")
        for name, have in self.plan.partial.items():
            self.progress.initial_bytes(name, have)
        self.todo = deque(self.by_name[n] for n in self.plan.to_check + self.plan.missing)
        self.to_check = set(self.plan.to_check)
        self.result = DownloadResult(ok=False)
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.why = ""                      # why the last failed file failed
        self.open: list[FileFetch] = []    # files being fetched, in order
        self.opening = 0                   # files being checked or opened right now
        self.client = None
        self.connections = 1

    def run(self, *, workers: int, on_progress: Callable[[ProgressEvent], None] | None,
            max_hz: float) -> DownloadResult:
        self.connections = max(1, workers)
        httpx = http()
        timeout = httpx.Timeout(self.opts.timeout_s, connect=min(10.0, self.opts.timeout_s))
        self.client = httpx.Client(timeout=timeout, follow_redirects=True,
                                   limits=httpx.Limits(max_connections=2 * max(1, workers)))
        try:
            # no listener, no ticker: its rate-limited last event would hold up the return
            with (Ticker(self.progress, on_progress, max_hz=max_hz) if on_progress
                  else contextlib.nullcontext()):
                self._run_workers(max(1, workers))
        finally:
            for fetch in self.open:
                fetch.close()
            self.client.close()
            self.store.close()
        return self._finish()

    def _run_workers(self, workers: int) -> None:
        threads = [threading.Thread(target=self._worker, name=f"dl-{i}", daemon=True)
                   for i in range(workers)]
        for t in threads:
            t.start()
        closed = False
        for t in threads:
            while t.is_alive():
                t.join(0.2)        # keeps the main thread responsive to signals
                if self.stop.is_set() and not closed:
                    with self.lock:
                        fetches = list(self.open)
                    for fetch in fetches:
                        fetch.abort()  # wakes reads stuck on a silent server
                    closed = True

    def _worker(self) -> None:
        while (work := self._next()) is not None:
            fetch, span = work
            try:
                if span is not None:
                    fetch.fetch(span)
                if fetch.settle() and fetch.finish():
                    self._close(fetch)
                with self.cv:
                    self.cv.notify_all()          # a restarted file has ranges again
            except Abandoned:
                pass
            except Cancelled:
                if not fetch.failed:
                    self.progress.status(fetch.rf.name, "pending")
            except Exception as exc:
                fetch.give_up()
                self._close(fetch)
                self._failed(fetch.rf, exc)

    def _next(self) -> tuple[FileFetch, object] | None:
        """The next range to fetch: of an open file nobody fetches, else of the next file
        in the queue (checked or opened here), else of the open file with the fewest
        connections. None when nothing is left for any connection:
        a connection waits while a file is being opened or verified, since either may
        bring work (a restarted file's ranges)."""
        with self.cv:
            while not self.stop.is_set():
                loads = [(load, i) for i, f in enumerate(self.open)
                         if (load := f.load()) is not None]
                if loads and (min(loads)[0] == 0 or not self.todo):
                    fetch = self.open[min(loads)[1]]
                    if (span := fetch.take()) is not None:
                        return fetch, span
                    continue
                if self.todo:
                    rf = self.todo.popleft()
                    self.opening += 1
                    break
                if not self.open and not self.opening:
                    return None
                self.cv.wait(0.2)
            else:
                return None
        fetch = None
        try:
            if rf.name in self.to_check and self._check_on_disk(rf):
                return self._next_after(None)
            fetch = FileFetch(rf, self.snapshot, self.store, self.progress, self.client,
                              self.opts, self.stop, self.log, self.connections)
            fetch.open(self.plan.partial.get(rf.name, 0))
        except Cancelled:
            self.progress.status(rf.name, "pending")
            fetch = None
        except Exception as exc:
            if fetch is not None:
                fetch.close()
            fetch = None
            self._failed(rf, exc)
        return self._next_after(fetch)

    def _next_after(self, fetch: FileFetch | None) -> tuple[FileFetch, object] | None:
        """A file was opened (or found complete, or failed: None): it counts as open."""
        with self.cv:
            self.opening -= 1
            if fetch is not None:
                self.open.append(fetch)
            self.cv.notify_all()
        return (fetch, fetch.take()) if fetch is not None else self._next()

    def _close(self, fetch: FileFetch) -> None:
        """A file is done with (verified or failed): out of the open list; its files are
        closed once no connection uses it any more."""
        with self.cv:
            if fetch in self.open:
                self.open.remove(fetch)
            self.cv.notify_all()
        fetch.retire()

    def _check_on_disk(self, rf: RemoteFile) -> bool:
        """A file already there: kept (and recorded) when its size and digest match."""
        self.progress.status(rf.name, "verifying")
        h = new_hasher(rf)
        final = self.store.final(rf.name)
        st = final.stat()
        if st.st_size == rf.size:
            hash_file(final, h, stop=self.stop)
            if self.stop.is_set():
                raise Cancelled()
            if h.hexdigest() == expected_digest(rf):
                self.store.record(rf.name, st.st_size, st.st_mtime_ns, expected_digest(rf),
                                  self.snapshot.commit)
                self.progress.initial_bytes(rf.name, rf.size)
                self.progress.status(rf.name, "done")
                with self.lock:
                    self.result.verified_now.append(rf.name)
                return True
        self.log(f"{rf.name}: the file on disk does not match the Hub (size or sha256); "
                 "fetching it again")
        self.store.forget(rf.name)
        final.unlink()
        with self.lock:
            self.result.replaced.append(rf.name)
        return False

    def _failed(self, rf: RemoteFile, exc: Exception) -> None:
        """One file's failure, in words; the ones no other file can get past stop them all."""
        if isinstance(exc, DiskFull) or is_disk_full(exc):
            left = sum(f.size for f in self.snapshot.files) - self.progress.snapshot().done_bytes
            self._fail(rf.name, f"{rf.name}: disk full",
                       disk_full_error(self.target, left, self.resume), halt=True)
        elif isinstance(exc, HubRefused):
            self._fail(rf.name, f"{rf.name}: {exc.error.message}", exc.error, halt=True)
        elif isinstance(exc, UnsafeName):     # a symlink appeared during the download
            self._fail(rf.name, exc.message, exc, halt=True)
        elif isinstance(exc, CorruptAtHub):
            self._fail(rf.name, exc.error.message, exc.error)
        elif isinstance(exc, FileFailed):
            self._fail(rf.name, str(exc))
        elif isinstance(exc, OSError):
            self._fail(rf.name, f"{rf.name}: {exc}")
        else:
            self.log(traceback.format_exc())
            self._fail(rf.name, f"{rf.name}: unexpected {type(exc).__name__}: {exc}")

    def _fail(self, name: str, why: str, error: K3Error | None = None,
              halt: bool = False) -> None:
        self.progress.status(name, "failed")
        self.progress.error(why, retry=False)
        self.log(why)
        with self.lock:
            self.result.failed.append(name)
            self.why = why
            if error is not None and self.result.error is None:
                self.result.error = error
        if halt:
            self.stop.set()

    def _finish(self) -> DownloadResult:
        result = self.result
        result.cancelled = self.stop.is_set() and result.error is None
        if not result.failed and not result.cancelled:
            for d in sorted((self.store.meta / "partial").rglob("*"), reverse=True):
                if d.is_dir():
                    with contextlib.suppress(OSError):
                        d.rmdir()          # only empty leftovers of nested file names
        result.ok = not result.failed and not result.cancelled
        if result.failed and result.error is None:
            last = self.why        # the last file's reason, not a retry logged after it
            n, shown = len(result.failed), ", ".join(result.failed[:3])
            result.error = K3Error(
                f"{n} of {len(self.snapshot.files)} files could not be downloaded "
                f"({shown}{'…' if n > 3 else ''})"
                + (f"; last error: {last.split(': ', 1)[-1]}" if last else "") + ".",
                "rerun the same `k3tui download` command: finished and partial files are kept")
        return result
