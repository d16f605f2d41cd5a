"""Fetch one file: Range resume, sha256 while streaming, retries, verify, then rename.

Why not `hf_hub_download`: huggingface_hub 2.x never resumes a partial across processes,
deletes partials on some errors, gives up at once on a reset or a 503 and trusts what is
on disk (see shared notes, part A). Here:

* bytes go to `.k3tui/partial/<name>.part` in CHUNK_BYTES writes; a sidecar says which
  content they belong to. Whole chunks (at multiples of CHUNK_BYTES) are copied into a
  page-aligned buffer and written with O_DIRECT: no page-cache copy, no writeback left for
  the final fdatasync, no cache growth; the rest (a file's tail, a resumed odd offset, a
  filesystem without O_DIRECT) is written buffered. After a kill the rerun asks
  `Range: bytes=<part size>-`, so at most one chunk (the one being filled) is fetched twice.
* after a transport error the pending chunk is written first, so an in-process retry
  re-sends nothing.
* the digest is computed while streaming in a helper thread (hashlib releases the GIL);
  a resumed prefix is re-hashed once per process.
* the token goes to the Hub only, never to a CDN on another origin.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from k3tui.errors import K3Error
from k3tui.hub.progress import Progress
from k3tui.hub.metadata import RemoteFile, RepoSnapshot, explain, is_transient, redact
from k3tui.hub.store import LocalStore, drop_page_cache, expected_digest, hash_file, new_hasher
from k3tui.units import KB, MiB

CHUNK_BYTES = MiB  # unit of writing, hence the most a kill can make us re-fetch
DROP_CACHE_EVERY = 64 << 20       # start writeback / drop cache of written ranges this often
SIDECAR_EVERY_S = 2.0

MAX_PIECES = 512                  # well under IOV_MAX (1024)
ALIGN = 4096                      # O_DIRECT offsets and lengths (CHUNK_BYTES is a multiple)
BUFFERS = 4                       # aligned chunk buffers per file: written, being hashed

pwritev = os.pwritev              # the write seam (tests inject ENOSPC here)


def _head(pieces: list[bytes], k: int) -> list[bytes]:
    """The first k bytes of a list of pieces."""
    out = []
    for p in pieces:
        if k <= 0:
            break
        out.append(p[:k])
        k -= len(p)
    return out


def _tail(pieces: list[bytes], k: int) -> list[bytes]:
    """Everything after the first k bytes."""
    out = []
    for p in pieces:
        if k >= len(p):
            k -= len(p)
            continue
        out.append(p[k:] if k else p)
        k = 0
    return out


@dataclass
class Options:
    timeout_s: float = 30.0           # connect / read timeout: a silent server is a stall
    backoff_s: float = 1.0            # first retry delay, doubled per failure, capped
    backoff_cap_s: float = 60.0
    max_failures: int = 8             # consecutive failed attempts without progress
    low_speed_bps: float = 4_000      # a connection slower than this for low_speed_s is
    low_speed_s: float = 60.0         # dropped and reopened (curl's --speed-limit idea)
    token: str | None = None
    retry_corrupt: bool = False       # fetch files known to arrive with a wrong digest again

    @classmethod
    def from_env(cls, **kw) -> Options:
        """Test and power-user knobs: K3TUI_DL_TIMEOUT_S, K3TUI_DL_BACKOFF_S,
        K3TUI_DL_MAX_FAILURES."""
        env = os.environ
        if "K3TUI_DL_TIMEOUT_S" in env:
            kw.setdefault("timeout_s", float(env["K3TUI_DL_TIMEOUT_S"]))
        if "K3TUI_DL_BACKOFF_S" in env:
            kw.setdefault("backoff_s", float(env["K3TUI_DL_BACKOFF_S"]))
        if "K3TUI_DL_MAX_FAILURES" in env:
            kw.setdefault("max_failures", int(env["K3TUI_DL_MAX_FAILURES"]))
        return cls(**kw)


class DiskFull(Exception):
    """ENOSPC/EDQUOT while writing: stop everything, keep the partials."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class Cancelled(Exception):
    pass


class FileFailed(Exception):
    """This file cannot be fetched now (others may continue)."""


class HubRefused(Exception):
    """Auth/gating/not-found: no point retrying or continuing with other files."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


class CorruptAtHub(Exception):
    """The file arrived twice with the same wrong digest: the Hub's digest is wrong (or its
    bytes are), so fetching it again is pointless until someone fixes the repo."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


class _HashThread:
    """Feeds chunks to a hasher on another thread so hashing overlaps receiving."""

    def __init__(self, hasher, done: queue.Queue):
        self.hasher, self._done = hasher, done   # `done` gets back each fed buffer once hashed
        self._q: queue.Queue = queue.Queue(maxsize=16)
        self._t = threading.Thread(target=self._run, name="hash", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            pieces, buf = item
            for piece in pieces:
                self.hasher.update(piece)
            if buf is not None:
                self._done.put(buf)

    def feed(self, pieces: list, buf=None) -> None:
        self._q.put((pieces, buf))

    def hexdigest(self) -> str:
        self._q.put(None)
        self._t.join()
        return self.hasher.hexdigest()


def same_origin(a: str, b: str) -> bool:
    ua, ub = urlsplit(a), urlsplit(b)
    return (ua.scheme, ua.hostname, ua.port) == (ub.scheme, ub.hostname, ub.port)


RETRY_AFTER_CAP_S = 600.0         # a server asking for longer is treated as asking for this


def retry_after_s(value: str | None, now: float | None = None) -> float:
    """Seconds a `Retry-After` header asks us to wait: delta-seconds or an HTTP date
    (RFC 9110), never negative, at most RETRY_AFTER_CAP_S; 0 if absent or unreadable."""
    from email.utils import parsedate_to_datetime

    value = (value or "").strip()
    if not value:
        return 0.0
    try:
        wait = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return 0.0
        if when.tzinfo is None:           # HTTP dates are GMT; a zone-less one is read so too
            import datetime

            when = when.replace(tzinfo=datetime.UTC)
        wait = when.timestamp() - (time.time() if now is None else now)
    return 0.0 if math.isnan(wait) else min(max(wait, 0.0), RETRY_AFTER_CAP_S)


def _retry_after(exc: BaseException) -> float:
    resp = getattr(exc, "response", None)
    headers = getattr(resp, "headers", None)
    return retry_after_s(headers.get("Retry-After") if headers is not None else None)


class FileFetch:
    """Everything about fetching one file; `run()` returns when it is verified in place."""

    def __init__(self, rf: RemoteFile, snap: RepoSnapshot, store: LocalStore,
                 progress: Progress, client, opts: Options,
                 stop: threading.Event, log=print):
        self.rf, self.snap, self.store, self.progress = rf, snap, store, progress
        self.client, self.opts, self.stop, self.log = client, opts, stop, log
        self.part = store.part(rf.name)
        self.have = 0
        self.hasher: _HashThread | None = None
        self.fd = -1
        self.dfd = -1                     # the same partial opened O_DIRECT, or -1
        self._buffers: queue.Queue = queue.Queue()    # aligned buffers back from hashing
        self._made = 0
        self._dropped_at = 0
        self._sidecar_t = 0.0
        self.etag = ""
        self._sock = None                 # the socket being read, for abort()

    def abort(self) -> None:
        """From another thread: shut the socket down so a blocked read returns now
        (closing an fd does not wake a thread blocked in recv on Linux)."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- lifecycle -------------------------------------------------------------------------
    def run(self, initial_counted: int) -> None:
        """`initial_counted`: partial bytes the caller already reported as initial."""
        rf, store = self.rf, self.store
        if store.known_corrupt(rf):
            if not self.opts.retry_corrupt:
                raise CorruptAtHub(self._corrupt_error(store.last_mismatch(rf)))
            store.note_mismatch(rf, store.last_mismatch(rf))   # once more: the same bytes stop it
        self.part.parent.mkdir(parents=True, exist_ok=True)
        keep = store.resumable_bytes(rf)
        if keep != initial_counted:   # partial changed since planning: recount honestly
            self.progress.reset_file(rf.name)
            self.progress.initial_bytes(rf.name, keep)
        self.fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self.dfd = _reopen_direct(self.fd)
        try:
            for attempt in range(2):  # a digest mismatch restarts the file once
                self._open_partial(keep)
                self._fetch_all()
                digest = self.hasher.hexdigest()
                if digest == expected_digest(rf) or not expected_digest(rf):  # size-only
                    # when the Hub gave no hash at all (not seen on huggingface.co)
                    self._finish(digest)
                    return
                if digest == store.last_mismatch(rf):
                    # the same wrong bytes twice (in this run or the one before): not the
                    # network's fault, so keep them for inspection and stop fetching them
                    self._set_aside(digest)
                    raise CorruptAtHub(self._corrupt_error(digest))
                store.note_mismatch(rf, digest)
                self.log(f"{rf.name}: digest mismatch (got {digest[:12]}…, expected "
                         f"{expected_digest(rf)[:12]}…); fetching it again")
                self.progress.error(f"{rf.name}: corrupt download, refetching")
                self.progress.reset_file(rf.name)
                keep = 0
            store.discard_partial(rf.name)
            raise FileFailed(f"{rf.name} arrived corrupt twice, with a different digest each "
                             "time (damaged in transit); rerun to fetch it again")
        finally:
            for fd in (self.fd, self.dfd):
                if fd >= 0:
                    os.close(fd)
            self.fd = self.dfd = -1

    def _set_aside(self, digest: str) -> None:
        """Move the corrupt partial to `.k3tui/corrupt/` and remember it arrived twice."""
        aside = self.store.corrupt(self.rf.name)
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.part, aside)
        self.store.sidecar(self.rf.name).unlink(missing_ok=True)
        self.store.note_mismatch(self.rf, digest, twice=True)
        self.progress.status(self.rf.name, "failed")

    def _corrupt_error(self, got: str | None) -> K3Error:
        rf = self.rf
        kind = "sha256" if rf.sha256 else "git blob sha1"
        return K3Error(f"The Hub's {kind} for {rf.name} does not match its bytes (got {got}, "
                       f"expected {expected_digest(rf)} twice).",
                       f"the copy is kept in {self.store.corrupt(rf.name)}; tell the repo's "
                       "owner, or rerun with --retry-corrupt to fetch it once more")

    def _open_partial(self, keep: int) -> None:
        os.ftruncate(self.fd, keep)
        self.have = keep
        h = new_hasher(self.rf)
        if keep:
            self.progress.status(self.rf.name, "verifying")   # re-hash the prefix, once
            if hash_file(self.part, h, keep, self.stop) != keep:
                raise Cancelled()
        self.hasher = _HashThread(h, self._buffers)
        self.store.write_sidecar(self.rf, self.snap.commit, keep)

    def _fetch_all(self) -> None:
        failures = 0
        while self.have < self.rf.size:
            if self.stop.is_set():
                raise Cancelled()
            before = self.have
            self.progress.status(self.rf.name, "downloading")
            try:
                self._attempt()
                continue
            except (DiskFull, Cancelled, HubRefused, FileFailed):
                raise
            except Exception as exc:
                if is_disk_full(exc):
                    raise DiskFull(str(exc)) from None
                if isinstance(exc, OSError) and not is_transient(exc):
                    raise                               # a local I/O problem, not the Hub's
                if not (is_transient(exc) or isinstance(exc, _BadResponse)):
                    raise HubRefused(explain(exc, self.snap.repo, self.snap.revision,
                                             self.opts.token or False)) from None
                failures = 1 if self.have > before else failures + 1
                first = str(exc).splitlines()[0] if str(exc) else ""
                what = f"{type(exc).__name__}: {redact(first)}"
                self.log(f"{self.rf.name}: {what} at byte {self.have:,}; "
                         f"retry {failures}/{self.opts.max_failures}")
                self.progress.error(f"{self.rf.name}: {what}")
                if failures >= self.opts.max_failures:
                    raise FileFailed(f"{self.rf.name}: gave up after {failures} failed "
                                     f"attempts in a row ({what})") from None
                self.progress.status(self.rf.name, "retrying")
                delay = min(self.opts.backoff_cap_s, self.opts.backoff_s * 2 ** (failures - 1))
                delay = max(delay * random.uniform(0.5, 1.0), _retry_after(exc))
                if self.stop.wait(delay):
                    raise Cancelled() from None

    # -- one HTTP attempt ----------------------------------------------------------------
    def _attempt(self) -> None:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        rf, snap = self.rf, self.snap
        url = hf_hub_url(snap.repo, rf.name, revision=snap.commit, endpoint=snap.endpoint)
        token = self.opts.token or False
        meta = get_hf_file_metadata(url, token=token, timeout=self.opts.timeout_s)
        if meta.size is not None and meta.size != rf.size:
            raise FileFailed(f"{rf.name} changed on the Hub ({meta.size:,} B, expected "
                             f"{rf.size:,} B); rerun `k3tui download` to pick up the change")
        self.etag = meta.etag or ""
        location = meta.location or url
        headers = {"Accept-Encoding": "identity", "User-Agent": "k3tui"}
        if token and same_origin(location, snap.endpoint):
            headers["Authorization"] = f"Bearer {token}"      # never to a CDN on another host
        if self.have:
            headers["Range"] = f"bytes={self.have}-"
        with self.client.stream("GET", location, headers=headers) as r:
            stream = r.extensions.get("network_stream")
            self._sock = stream.get_extra_info("socket") if stream is not None else None
            if self.stop.is_set():
                raise Cancelled()
            if r.status_code == 416 and self.have == rf.size:
                return
            if r.status_code not in (200, 206):
                r.read()
                r.raise_for_status()
                raise _BadResponse(f"unexpected HTTP {r.status_code}")
            skip = 0
            if r.status_code == 200 and self.have:
                skip = self.have               # Range ignored: discard what we already have
                self.log(f"{rf.name}: server ignored Range; skipping {skip:,} bytes")
            elif r.status_code == 206:
                cr = r.headers.get("Content-Range", "")
                if not cr.startswith(f"bytes {self.have}-"):
                    raise _BadResponse(f"Content-Range {cr!r} does not start at {self.have}")
            self._receive(r, skip)

    def _receive(self, r, skip: int) -> None:
        """Collect received pieces until a chunk is full, then write them with one pwritev
        (no copy into a buffer); whatever arrived is written even when the stream breaks."""
        pieces: list[bytes] = []
        n = 0
        window_t, window_bytes = time.monotonic(), 0
        try:
            for piece in r.iter_raw():
                if self.stop.is_set():
                    raise Cancelled()
                window_bytes += len(piece)
                now = time.monotonic()
                if now - window_t >= self.opts.low_speed_s:
                    rate = window_bytes / (now - window_t)
                    if rate < self.opts.low_speed_bps:      # a trickle never times out
                        raise _BadResponse(f"too slow ({rate / KB:,.1f} kB/s for "
                                           f"{now - window_t:.0f} s); reconnecting")
                    window_t, window_bytes = now, 0
                if skip:
                    if len(piece) <= skip:
                        skip -= len(piece)
                        continue
                    piece, skip = piece[skip:], 0
                if len(piece) > self.rf.size - self.have - n:
                    raise _BadResponse("server sent more bytes than the file has")
                pieces.append(piece)
                n += len(piece)
                want = CHUNK_BYTES - self.have % CHUNK_BYTES   # up to the next chunk boundary
                if n >= want:
                    self._write(_head(pieces, want), want)
                    pieces, n = _tail(pieces, want), n - want
                elif len(pieces) >= MAX_PIECES:
                    self._write(pieces, n)
                    pieces, n = [], 0
        finally:
            if n:                               # keep every byte that arrived
                self._write(pieces, n)

    def _write(self, pieces: list[bytes], n: int) -> None:
        """Write the pieces at `have`, hash them, count them. ENOSPC keeps what fit."""
        buf = None
        if self.dfd >= 0 and self.have % ALIGN == 0 and n % ALIGN == 0:
            buf = self._buffer()
            pos = 0
            for piece in pieces:
                buf[pos:pos + len(piece)] = piece
                pos += len(piece)
            pieces = [buf[:n]]
        written = 0
        try:
            while written < n:
                written += self._pwrite(_tail(pieces, written), self.have + written)
        except OSError as exc:
            if written:
                self._accept(_head(pieces, written), written, buf)
                buf = None
            if buf is not None:
                self._buffers.put(buf)
            if is_disk_full(exc):
                self.store.write_sidecar(self.rf, self.snap.commit, self.have, self.etag)
                raise DiskFull(str(exc)) from None
            raise
        self._accept(pieces, n, buf)

    def _buffer(self) -> memoryview:
        """An aligned chunk buffer the hash thread is done with (BUFFERS per file)."""
        try:
            return self._buffers.get_nowait()
        except queue.Empty:
            if self._made < BUFFERS:
                self._made += 1
                return memoryview(mmap.mmap(-1, CHUNK_BYTES))   # page-aligned
            return self._buffers.get()

    def _pwrite(self, pieces: list, offset: int) -> int:
        """O_DIRECT when the write is aligned, else buffered; a filesystem that refuses
        our O_DIRECT write (EINVAL) gets buffered writes from then on."""
        if self.dfd >= 0 and offset % ALIGN == 0 and sum(map(len, pieces)) % ALIGN == 0:
            try:
                return pwritev(self.dfd, pieces, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self.dfd)
                self.dfd = -1
        return pwritev(self.fd, pieces, offset)

    def _accept(self, pieces: list, n: int, buf=None) -> None:
        self.hasher.feed(pieces, buf)
        self.have += n
        self.progress.add(self.rf.name, n)
        if self.have - self._dropped_at >= DROP_CACHE_EVERY:
            drop_page_cache(self.fd, 0, self.have)   # start writeback, forget clean pages
            self._dropped_at = self.have
        now = time.monotonic()
        if now - self._sidecar_t >= SIDECAR_EVERY_S:
            self._sidecar_t = now
            self.store.write_sidecar(self.rf, self.snap.commit, self.have, self.etag)

    def _finish(self, digest: str) -> None:
        rf, final = self.rf, self.store.final(self.rf.name)
        os.fdatasync(self.fd)
        drop_page_cache(self.fd)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.part, final)
        self.store.sidecar(rf.name).unlink(missing_ok=True)
        self.store.note_mismatch(rf, None)
        st = final.stat()
        self.store.record(rf.name, st.st_size, st.st_mtime_ns, digest, self.snap.commit)
        self.progress.status(rf.name, "done")


def _reopen_direct(fd: int) -> int:
    """The file open on `fd` opened again for O_DIRECT writes (the same inode, not the path
    again); -1 where the platform or filesystem has no O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return -1
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return -1


class _BadResponse(Exception):
    """The server answered something inconsistent: retry like a transport error."""
