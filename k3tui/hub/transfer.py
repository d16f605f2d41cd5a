"""Fetch one file over several connections: byte ranges, each resumable, sha256 at the end.

Why not `hf_hub_download`: huggingface_hub 2.x never resumes a partial across processes,
deletes partials on some errors, gives up at once on a reset or a 503 and trusts what is
on disk (see shared notes, part A). And the Hub's CDN caps each connection, so a 16 GB
shard over one connection takes as long as the cap says. Here:

* a file is cut into ranges of `range_bytes` (a grid fixed per partial); each is an HTTP
  Range request that any free connection takes, in file order, so several connections
  fill one file at once. A file no larger than one range is one plain GET.
* bytes go to `.k3tui/partial/<name>.part` (sparse while ranges are missing); the sidecar
  `.part.json` says which content they belong to, and `.part.map` holds one 8-byte counter
  per range: the bytes on disk from that range's start, rewritten (8 bytes, in place) after
  every write, so after a kill the rerun asks each range for exactly what is missing and at
  most the chunk being filled on each connection is fetched twice.
* whole chunks (CHUNK_BYTES at multiples of it) are copied into a page-aligned buffer and
  written with O_DIRECT: no page-cache copy, no writeback left for the final fdatasync; the
  rest (a file's tail, a resumed odd offset, a filesystem without O_DIRECT) is buffered.
* after a transport error the pending chunk is written first, so a retry re-sends nothing.
* sha256 runs in file order on a helper thread (hashlib releases the GIL) while ranges
  arrive: from the written buffers when they are near the hashing point (HASH_WINDOW),
  else read back from the partial (so memory stays bounded and a resumed file's bytes on
  disk are hashed once). The digest is compared with the Hub's before the rename.
* a 206 must be exactly the range asked for (Content-Range and length); a server that
  ignores Range (200, whole body) is read from the range's start, then over one connection.
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
from k3tui.hub.store import LocalStore, drop_page_cache, expected_digest, new_hasher
from k3tui.units import KB, MiB

CHUNK_BYTES = MiB  # unit of writing, hence the most a kill can make a connection re-fetch
RANGE_BYTES = 64 * MiB            # one Range request at most (see Options.range_bytes)
MIN_RANGE = 8 * MiB               # a file is not cut finer to keep every connection busy
HASH_WINDOW = 64 * MiB            # written bytes kept in memory for the hash, per file
DROP_CACHE_EVERY = 64 << 20       # start writeback / drop cache of written ranges this often

MAX_PIECES = 512                  # well under IOV_MAX (1024)
ALIGN = 4096                      # O_DIRECT offsets and lengths (CHUNK_BYTES is a multiple)
HASH_BLOCK = 8 << 20              # read-back size of the hash thread

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
    range_bytes: int = RANGE_BYTES    # size of one Range request (a multiple of CHUNK_BYTES)

    @classmethod
    def from_env(cls, **kw) -> Options:
        """Test and power-user knobs: K3TUI_DL_TIMEOUT_S, K3TUI_DL_BACKOFF_S,
        K3TUI_DL_MAX_FAILURES, K3TUI_DL_RANGE_MIB."""
        env = os.environ
        if "K3TUI_DL_TIMEOUT_S" in env:
            kw.setdefault("timeout_s", float(env["K3TUI_DL_TIMEOUT_S"]))
        if "K3TUI_DL_BACKOFF_S" in env:
            kw.setdefault("backoff_s", float(env["K3TUI_DL_BACKOFF_S"]))
        if "K3TUI_DL_MAX_FAILURES" in env:
            kw.setdefault("max_failures", int(env["K3TUI_DL_MAX_FAILURES"]))
        if "K3TUI_DL_RANGE_MIB" in env:
            kw.setdefault("range_bytes", max(1, int(env["K3TUI_DL_RANGE_MIB"])) * CHUNK_BYTES)
        return cls(**kw)


class DiskFull(Exception):
    """ENOSPC/EDQUOT while writing: stop everything, keep the partials."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class Cancelled(Exception):
    pass


class Abandoned(Exception):
    """Another connection gave this file up: stop working on it quietly."""


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


def _add(spans: list[list[int]], a: int, b: int) -> None:
    """Add [a, b) to a sorted list of disjoint [start, end) spans, merging neighbours."""
    i = 0
    while i < len(spans) and spans[i][1] < a:
        i += 1
    while i < len(spans) and spans[i][0] <= b:
        s = spans.pop(i)
        a, b = min(a, s[0]), max(b, s[1])
    spans.insert(i, [a, b])


class _OrderedHash:
    """Hashes a file in order while its ranges arrive in any order: from the buffers the
    connections hand over when they lie within HASH_WINDOW of the hashing point, else by
    reading the partial back (`rfd`) once the bytes are on disk."""

    def __init__(self, hasher, size: int, rfd: int, release, window: int = HASH_WINDOW):
        self.hasher, self.size, self.rfd, self.release, self.window = \
            hasher, size, rfd, release, window
        self.pos = 0                              # bytes hashed
        self.mem: dict[int, tuple[int, list, object]] = {}   # start -> (end, pieces, buf)
        self.disk: list[list[int]] = []           # spans written
        self.closed = False
        self.cond = threading.Condition()
        self.finished = threading.Event()
        self._t = threading.Thread(target=self._run, name="hash", daemon=True)
        self._t.start()

    def written(self, a: int, b: int, pieces: list | None = None, buf=None) -> None:
        """[a, b) is on disk; `pieces` (backed by `buf`, if any) are its bytes."""
        with self.cond:
            keep = pieces is not None and not self.closed and \
                self.pos <= a < self.pos + self.window
            if keep:
                self.mem[a] = (b, pieces, buf)
            _add(self.disk, a, b)
            self.cond.notify()
        if not keep and buf is not None:
            self.release(buf)

    def _next(self):
        """Under the lock: what to hash next, (pieces, buf, end) or (None, None, end)."""
        while not self.closed:
            if self.pos in self.mem:
                end, pieces, buf = self.mem.pop(self.pos)
                return pieces, buf, end
            span = next((s for s in self.disk if s[0] <= self.pos < s[1]), None)
            if span is not None:
                nxt = min((k for k in self.mem if k > self.pos), default=self.size)
                return None, None, min(span[1], nxt, self.pos + HASH_BLOCK)
            self.cond.wait()
        return None, None, None

    def _run(self) -> None:
        while self.pos < self.size:
            with self.cond:
                pieces, buf, end = self._next()
            if end is None:
                return
            if pieces is None:
                data = os.pread(self.rfd, end - self.pos, self.pos)
                drop_page_cache(self.rfd, self.pos, end - self.pos)
                pieces = [data.ljust(end - self.pos, b"\0")]   # a short read: a wrong digest
            for piece in pieces:
                self.hasher.update(piece)
            if buf is not None:
                self.release(buf)
            with self.cond:
                self.pos = end
                for k in [k for k in self.mem if k < end]:    # superseded by a read-back
                    _, _, old = self.mem.pop(k)
                    if old is not None:
                        self.release(old)
        self.finished.set()

    def hexdigest(self, stop: threading.Event) -> str:
        while not self.finished.wait(0.2):
            if stop.is_set() or self.closed:
                raise Cancelled()
        return self.hasher.hexdigest()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self._t.join()
        for _, _, buf in self.mem.values():
            if buf is not None:
                self.release(buf)
        self.mem.clear()


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


def range_size(size: int, connections: int, most: int) -> int:
    """Bytes per range of a file: `most`, or less for a file that would otherwise leave
    connections idle (a whole number of chunks, MIN_RANGE at least, never above `most`)."""
    share = -(-size // max(1, connections))
    return min(most, max(MIN_RANGE, -(-share // CHUNK_BYTES) * CHUNK_BYTES))


class _Span:
    """One connection's share of a file: bytes [pos, end) still to receive."""

    def __init__(self, start: int, end: int):
        self.pos, self.end = start, end
        self.sock = None                  # the socket being read, for abort()


class FileFetch:
    """Everything about fetching one file, shared by the connections working on it:
    `open()`, then each connection `take()`s a span and `fetch()`es it; whoever finds
    nothing left to fetch (`settle()`) calls `finish()`, which verifies and renames."""

    def __init__(self, rf: RemoteFile, snap: RepoSnapshot, store: LocalStore,
                 progress: Progress, client, opts: Options,
                 stop: threading.Event, log=print, connections: int = 1):
        self.rf, self.snap, self.store, self.progress = rf, snap, store, progress
        self.client, self.opts, self.stop, self.log = client, opts, stop, log
        self.part = store.part(rf.name)
        self.lock = threading.Lock()
        self.grid = range_size(rf.size, connections, opts.range_bytes)
        self.todo: list[tuple[int, int]] = []   # spans nobody fetches yet, in file order
        self.active: set[_Span] = set()
        self.failed = False               # a connection gave the file up; the others stop
        self.finalizing = False
        self.no_ranges = False            # the server answered a Range with the whole file
        self.restarted = False            # a digest mismatch restarts the file once
        self.retired = False              # no more work: close when the last span leaves
        self.hasher: _OrderedHash | None = None
        self.fd = self.dfd = self.rfd = self.mapfd = -1
        self._free: queue.SimpleQueue = queue.SimpleQueue()   # aligned chunk buffers
        self._unflushed = 0
        self.etag = ""
        self._location: str | None = None  # where the bytes are (the CDN), once resolved

    def abort(self) -> None:
        """From another thread: shut the sockets down so blocked reads return now
        (closing an fd does not wake a thread blocked in recv on Linux)."""
        with self.lock:
            socks = [s.sock for s in self.active if s.sock is not None]
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- lifecycle -------------------------------------------------------------------------
    def open(self, initial_counted: int) -> None:
        """`initial_counted`: partial bytes the caller already reported as initial."""
        rf, store = self.rf, self.store
        if store.known_corrupt(rf):
            if not self.opts.retry_corrupt:
                raise CorruptAtHub(self._corrupt_error(store.last_mismatch(rf)))
            store.note_mismatch(rf, store.last_mismatch(rf))   # once more: the same bytes stop it
        self.part.parent.mkdir(parents=True, exist_ok=True)
        kept = store.resume_state(rf, self.grid)
        if kept is not None and (kept[0] <= 0 or kept[0] % CHUNK_BYTES):
            kept = None                   # not a grid we write: start over
        if kept is not None:
            self.grid = kept[0]
        have = kept[1] if kept else []
        if sum(have) != initial_counted:   # partial changed since planning: recount honestly
            self.progress.reset_file(rf.name)
            self.progress.initial_bytes(rf.name, sum(have))
        flags = os.O_CREAT | os.O_NOFOLLOW
        self.fd = os.open(self.part, os.O_WRONLY | flags, 0o644)
        self.rfd = os.open(self.part, os.O_RDONLY | os.O_NOFOLLOW)
        self.mapfd = os.open(store.range_map(rf.name), os.O_RDWR | flags, 0o644)
        self.dfd = _reopen_direct(self.fd)
        self._start(have if sum(have) else None)

    def _start(self, have: list[int] | None) -> None:
        """Begin (again) with `have[k]` bytes of range k on disk (None: nothing kept)."""
        rf, grid = self.rf, self.grid
        cells = -(-rf.size // grid)
        if have is None:                  # start over: no stale bytes, a zeroed map
            have = [0] * cells
            os.ftruncate(self.fd, 0)
        os.ftruncate(self.mapfd, 0)
        os.pwrite(self.mapfd, b"".join(k.to_bytes(8, "little") for k in have), 0)
        self.store.write_sidecar(rf, self.snap.commit, grid, self.etag)
        self.hasher = _OrderedHash(new_hasher(rf), rf.size, self.rfd, self._free.put)
        self.todo = []
        for k, got in enumerate(have):
            a, b = k * grid, min(rf.size, (k + 1) * grid)
            if got:
                self.hasher.written(a, a + got)
            if a + got < b:
                self.todo.append((a + got, b))
        if any(have):
            self.progress.status(rf.name, "verifying")   # the kept bytes are hashed once

    def close(self) -> None:
        """Stop the hash thread and close the files (once no connection writes)."""
        with self.lock:
            fds, self.fd, self.dfd, self.rfd, self.mapfd = \
                (self.fd, self.dfd, self.rfd, self.mapfd), -1, -1, -1, -1
        if self.hasher is not None:
            self.hasher.close()
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def retire(self) -> None:
        """Nobody takes this file's spans any more: close it now, or when the connections
        still on it leave."""
        with self.lock:
            self.retired = True
            idle = not self.active
        if idle:
            self.close()

    def take(self) -> _Span | None:
        """The next span nobody fetches yet (None: none now). Against a server that ignores
        Range only one connection works on the file, over the contiguous rest."""
        with self.lock:
            if self.failed or not self.todo or (self.no_ranges and self.active):
                return None
            a, b = self.todo.pop(0)
            while self.no_ranges and self.todo and self.todo[0][0] == b:
                b = self.todo.pop(0)[1]
            span = _Span(a, b)
            self.active.add(span)
            return span

    def load(self) -> int | None:
        """Connections on this file now, or None when it has no span to give."""
        with self.lock:
            if self.failed or not self.todo or (self.no_ranges and self.active):
                return None
            return len(self.active)

    def settle(self) -> bool:
        """True once, for the caller that should verify: every span fetched."""
        with self.lock:
            if self.failed or self.finalizing or self.todo or self.active:
                return False
            self.finalizing = True
            return True

    def give_up(self) -> None:
        with self.lock:
            self.failed = True

    def finish(self) -> bool:
        """Verify the digest; True when the file is in place, False when it was restarted
        (a first mismatch: the connections fetch it again)."""
        rf, store = self.rf, self.store
        self.progress.status(rf.name, "verifying")
        digest = self.hasher.hexdigest(self.stop)
        if digest == expected_digest(rf) or not expected_digest(rf):   # size-only when the
            self._finish(digest)                     # Hub gave no hash (not seen on hf.co)
            return True
        if digest == store.last_mismatch(rf):
            # the same wrong bytes twice (in this run or the one before): not the network's
            # fault, so keep them for inspection and stop fetching them
            self._set_aside(digest)
            raise CorruptAtHub(self._corrupt_error(digest))
        store.note_mismatch(rf, digest)
        if self.restarted:
            store.discard_partial(rf.name)
            raise FileFailed(f"{rf.name} arrived corrupt twice, with a different digest each "
                             "time (damaged in transit); rerun to fetch it again")
        self.log(f"{rf.name}: digest mismatch (got {digest[:12]}…, expected "
                 f"{expected_digest(rf)[:12]}…); fetching it again")
        self.progress.error(f"{rf.name}: corrupt download, refetching")
        self.progress.reset_file(rf.name)
        self.hasher.close()
        with self.lock:
            self.restarted, self.finalizing = True, False
            self._start(None)
        return False

    def _set_aside(self, digest: str) -> None:
        """Move the corrupt partial to `.k3tui/corrupt/` and remember it arrived twice."""
        aside = self.store.corrupt(self.rf.name)
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.part, aside)
        self.store.discard_partial(self.rf.name)
        self.store.note_mismatch(self.rf, digest, twice=True)
        self.progress.status(self.rf.name, "failed")

    def _corrupt_error(self, got: str | None) -> K3Error:
        rf = self.rf
        kind = "sha256" if rf.sha256 else "git blob sha1"
        return K3Error(f"The Hub's {kind} for {rf.name} does not match its bytes (got {got}, "
                       f"expected {expected_digest(rf)} twice).",
                       f"the copy is kept in {self.store.corrupt(rf.name)}; tell the repo's "
                       "owner, or rerun with --retry-corrupt to fetch it once more")

    def fetch(self, span: _Span) -> None:
        """Receive the span, retrying transport errors with backoff; what arrived stays."""
        failures = 0
        try:
            while span.pos < span.end:
                if self.stop.is_set():
                    raise Cancelled()
                if self.failed:
                    raise Abandoned()
                before = span.pos
                self.progress.status(self.rf.name, "downloading")
                try:
                    self._attempt(span)
                    continue
                except (DiskFull, Cancelled, Abandoned, HubRefused, FileFailed):
                    raise
                except Exception as exc:
                    failures = 1 if span.pos > before else failures + 1
                    self._after_error(exc, span, failures)
        finally:
            with self.lock:
                self.active.discard(span)
                if span.pos < span.end:               # not fetched: someone else may
                    self.todo.append((span.pos, span.end))
                    self.todo.sort()
                last_out = self.retired and not self.active
            if last_out:
                self.close()

    def _after_error(self, exc: Exception, span: _Span, failures: int) -> None:
        """Classify a failed attempt: raise what no retry helps, else wait to retry."""
        if self.failed:
            raise Abandoned()                           # another connection said why
        if is_disk_full(exc):
            raise DiskFull(str(exc)) from None
        if isinstance(exc, OSError) and not is_transient(exc):
            raise exc                                   # a local I/O problem, not the Hub's
        stale = self._location is not None and not isinstance(exc, _BadResponse)
        self._location = None                           # resolve (sign) the URL again
        if not (is_transient(exc) or isinstance(exc, _BadResponse) or stale and failures == 1):
            raise HubRefused(explain(exc, self.snap.repo, self.snap.revision,
                                     self.opts.token or False)) from None
        first = str(exc).splitlines()[0] if str(exc) else ""
        what = f"{type(exc).__name__}: {redact(first)}"
        self.log(f"{self.rf.name}: {what} at byte {span.pos:,}; "
                 f"retry {failures}/{self.opts.max_failures}")
        self.progress.error(f"{self.rf.name}: {what}")
        if failures >= self.opts.max_failures:
            self.give_up()
            raise FileFailed(f"{self.rf.name}: gave up after {failures} failed "
                             f"attempts in a row ({what})") from None
        self.progress.status(self.rf.name, "retrying")
        delay = min(self.opts.backoff_cap_s, self.opts.backoff_s * 2 ** (failures - 1))
        delay = max(delay * random.uniform(0.5, 1.0), _retry_after(exc))
        if self.stop.wait(delay):
            raise Cancelled() from None

    # -- one HTTP attempt ----------------------------------------------------------------
    def _resolve(self) -> str:
        """The URL of the bytes (the Hub's redirect to its CDN), asked once per file and
        again after an error (a signed URL can expire)."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        if self._location is not None:
            return self._location
        rf, snap = self.rf, self.snap
        url = hf_hub_url(snap.repo, rf.name, revision=snap.commit, endpoint=snap.endpoint)
        meta = get_hf_file_metadata(url, token=self.opts.token or False,
                                    timeout=self.opts.timeout_s)
        if meta.size is not None and meta.size != rf.size:
            raise FileFailed(f"{rf.name} changed on the Hub ({meta.size:,} B, expected "
                             f"{rf.size:,} B); rerun `k3tui download` to pick up the change")
        self.etag = meta.etag or ""
        self._location = meta.location or url
        return self._location

    def _attempt(self, span: _Span) -> None:
        rf, snap, token = self.rf, self.snap, self.opts.token
        location = self._resolve()
        headers = {"Accept-Encoding": "identity", "User-Agent": "k3tui"}
        if token and same_origin(location, snap.endpoint):
            headers["Authorization"] = f"Bearer {token}"      # never to a CDN on another host
        whole = span.pos == 0 and span.end == rf.size
        if not whole:
            headers["Range"] = f"bytes={span.pos}-{'' if span.end == rf.size else span.end - 1}"
        with self.client.stream("GET", location, headers=headers) as r:
            stream = r.extensions.get("network_stream")
            span.sock = stream.get_extra_info("socket") if stream is not None else None
            if self.stop.is_set():
                raise Cancelled()
            if r.status_code == 416:
                raise _BadResponse(f"the server refused bytes {span.pos}- of {rf.size} (416)")
            if r.status_code not in (200, 206):
                r.read()
                r.raise_for_status()
                raise _BadResponse(f"unexpected HTTP {r.status_code}")
            skip = 0
            if r.status_code == 200:
                _check_length(r.headers, rf.size, "the whole file")
                if not whole:
                    skip = span.pos                     # Range ignored: read from our start
                    self._ranges_ignored(span)
            else:
                _check_range(r.headers, span.pos, span.end, rf.size)
            self._receive(r, span, skip)

    def _ranges_ignored(self, span: _Span) -> None:
        """The server sends whole files: this connection reads on through the spans that
        follow, and no other connection starts one (each would re-send the prefix)."""
        with self.lock:
            if not self.no_ranges:
                self.log(f"{self.rf.name}: the server ignored Range; fetching the rest over "
                         "one connection")
            self.no_ranges = True
            while self.todo and self.todo[0][0] == span.end:
                span.end = self.todo.pop(0)[1]

    def _receive(self, r, span: _Span, skip: int) -> None:
        """Collect received pieces until a chunk is full, then write them with one pwritev
        (no copy into a buffer); whatever arrived is written even when the stream breaks."""
        pieces: list[bytes] = []
        n = 0
        window_t, window_bytes = time.monotonic(), 0
        try:
            for piece in r.iter_raw():
                if self.stop.is_set():
                    raise Cancelled()
                if self.failed:
                    raise Abandoned()
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
                left = span.end - span.pos - n
                if len(piece) > left:
                    if r.status_code == 206:
                        raise _BadResponse("server sent more bytes than the range has")
                    piece = piece[:left]                # a whole file: only our spans
                pieces.append(piece)
                n += len(piece)
                want = CHUNK_BYTES - span.pos % CHUNK_BYTES   # up to the next chunk boundary
                if n >= want:
                    self._write(span, _head(pieces, want), want)
                    pieces, n = _tail(pieces, want), n - want
                elif len(pieces) >= MAX_PIECES:
                    self._write(span, pieces, n)
                    pieces, n = [], 0
                if span.pos + n >= span.end:
                    break                               # the rest of a whole-file answer
        finally:
            if n:                               # keep every byte that arrived
                self._write(span, pieces, n)

    def _write(self, span: _Span, pieces: list[bytes], n: int) -> None:
        """Write the pieces at the span's position, hash them, count them. ENOSPC keeps
        what fit."""
        buf = None
        at = span.pos
        if self.dfd >= 0 and at % ALIGN == 0 and n % ALIGN == 0:
            buf = self._buffer()
            pos = 0
            for piece in pieces:
                buf[pos:pos + len(piece)] = piece
                pos += len(piece)
            pieces = [buf[:n]]
        written = 0
        try:
            while written < n:
                written += self._pwrite(_tail(pieces, written), at + written)
        except OSError as exc:
            if written:
                self._accept(span, _head(pieces, written), written, buf)
                buf = None
            if buf is not None:
                self._free.put(buf)
            if is_disk_full(exc):
                raise DiskFull(str(exc)) from None
            raise
        self._accept(span, pieces, n, buf)

    def _buffer(self) -> memoryview:
        """An aligned chunk buffer nobody uses (the hash thread hands them back)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return memoryview(mmap.mmap(-1, CHUNK_BYTES))   # page-aligned

    def _pwrite(self, pieces: list, offset: int) -> int:
        """O_DIRECT when the write is aligned, else buffered; a filesystem that refuses
        our O_DIRECT write (EINVAL) gets buffered writes from then on."""
        dfd = self.dfd
        if dfd >= 0 and offset % ALIGN == 0 and sum(map(len, pieces)) % ALIGN == 0:
            try:
                return pwritev(dfd, pieces, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.dfd = -1                   # closed with the others in close()
                os.close(dfd)
        return pwritev(self.fd, pieces, offset)

    def _accept(self, span: _Span, pieces: list, n: int, buf=None) -> None:
        """[pos, pos + n) is on disk: record it in the range map (what a rerun trusts),
        hand it to the hash, count it."""
        at = span.pos
        span.pos += n
        cell = at // self.grid
        os.pwrite(self.mapfd, (span.pos - cell * self.grid).to_bytes(8, "little"), cell * 8)
        self.hasher.written(at, at + n, pieces, buf)
        self.progress.add(self.rf.name, n)
        with self.lock:
            self._unflushed += n
            flush = self._unflushed >= DROP_CACHE_EVERY
            if flush:
                self._unflushed = 0
        if flush:
            drop_page_cache(self.fd)            # start writeback, forget clean pages

    def _finish(self, digest: str) -> None:
        rf, final = self.rf, self.store.final(self.rf.name)
        os.fdatasync(self.fd)
        drop_page_cache(self.fd)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.part, final)
        self.store.discard_partial(rf.name)
        self.store.note_mismatch(rf, None)
        st = final.stat()
        self.store.record(rf.name, st.st_size, st.st_mtime_ns, digest, self.snap.commit)
        self.progress.status(rf.name, "done")


def _check_length(headers, want: int, what: str) -> None:
    length = headers.get("Content-Length")
    if length is not None and length.strip() != str(want):
        raise _BadResponse(f"the server announced {length!r} bytes for {what} of {want:,}")


def _check_range(headers, start: int, end: int, size: int) -> None:
    """A 206 must carry exactly the bytes asked for: `Content-Range: bytes start-(end-1)/size`
    and as many bytes in Content-Length."""
    import re

    cr = headers.get("Content-Range", "")
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", cr.strip())
    if not m or (int(m[1]), int(m[2]) + 1, int(m[3])) != (start, end, size):
        raise _BadResponse(f"Content-Range {cr[:80]!r} is not the range asked for "
                           f"(bytes {start}-{end - 1} of {size})")
    _check_length(headers, end - start, f"bytes {start}-{end - 1}")


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
