"""The local side of a download: where partials, sidecars and verification records live.

Layout inside the target folder (all on one filesystem, so the final rename is atomic):

    <name>                              a verified file, in place
    .k3tui/partial/<name>.part          bytes received so far
    .k3tui/partial/<name>.part.json     sidecar: expected digest, size, commit, etag, written
    .k3tui/verified.json                {name: {size, mtime_ns, digest, commit}}: a file whose
                                        size and mtime still match is not re-hashed
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from k3tui.hub.remote import RemoteFile

HASH_BLOCK = 8 << 20


def expected_digest(rf: RemoteFile) -> str:
    return rf.sha256 or rf.blob_id or ""


def new_hasher(rf: RemoteFile):
    """sha256 for LFS files; git's blob sha1 (header + bytes) for small ones."""
    if rf.sha256 or not rf.blob_id:
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(b"blob %d\0" % rf.size)
    return h


def drop_page_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to forget cached pages (it also starts writeback of dirty ones).

    On unified-memory machines (DGX Spark) the page cache competes with the GPU.
    """
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def hash_file(path: Path, hasher, length: int | None = None, stop=None) -> int:
    """Feed `length` bytes (default: all) of `path` to `hasher`; returns bytes read."""
    done = 0
    with open(path, "rb") as fh:
        while length is None or done < length:
            if stop is not None and stop.is_set():
                break
            want = HASH_BLOCK if length is None else min(HASH_BLOCK, length - done)
            block = fh.read(want)
            if not block:
                break
            hasher.update(block)
            done += len(block)
        drop_page_cache(fh.fileno())
    return done


def atomic_write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)   # e.g. ENOSPC: leave the previous version intact
        raise


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class LocalStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.meta = self.root / ".k3tui"
        self._lock = threading.Lock()

    def final(self, name: str) -> Path:
        return self.root / name

    def part(self, name: str) -> Path:
        return self.meta / "partial" / f"{name}.part"

    def sidecar(self, name: str) -> Path:
        return self.meta / "partial" / f"{name}.part.json"

    @property
    def records_file(self) -> Path:
        return self.meta / "verified.json"

    def ensure(self) -> None:
        (self.meta / "partial").mkdir(parents=True, exist_ok=True)

    # -- verification records --------------------------------------------------------------
    def records(self) -> dict:
        return read_json(self.records_file) or {}

    def record(self, name: str, size: int, mtime_ns: int, digest: str, commit: str) -> None:
        with self._lock:
            recs = self.records()
            recs[name] = {"size": size, "mtime_ns": mtime_ns, "digest": digest,
                          "commit": commit}
            atomic_write_json(self.records_file, recs)

    def forget(self, name: str) -> None:
        with self._lock:
            recs = self.records()
            if recs.pop(name, None) is not None:
                atomic_write_json(self.records_file, recs)

    def recorded_ok(self, rf: RemoteFile, mtime: bool = True) -> bool:
        """The final file is what we verified last time: same digest and size (and mtime)."""
        rec = self.records().get(rf.name)
        try:
            st = self.final(rf.name).stat()
        except OSError:
            return False
        return bool(rec) and rec.get("digest") == expected_digest(rf) and \
            rec.get("size") == st.st_size == rf.size and \
            (not mtime or rec.get("mtime_ns") == st.st_mtime_ns)

    # -- partials ----------------------------------------------------------------------------
    def resumable_bytes(self, rf: RemoteFile) -> int:
        """Bytes of a partial we may keep: only if its sidecar is for the same content."""
        side = read_json(self.sidecar(rf.name))
        try:
            have = self.part(rf.name).stat().st_size
        except OSError:
            return 0
        if not side or side.get("expected") != expected_digest(rf) or side.get("size") != rf.size:
            return 0
        return min(have, rf.size)

    def write_sidecar(self, rf: RemoteFile, commit: str, written: int, etag: str = "") -> None:
        atomic_write_json(self.sidecar(rf.name), {
            "name": rf.name, "size": rf.size, "expected": expected_digest(rf),
            "commit": commit, "etag": etag, "written": written})

    def discard_partial(self, name: str) -> None:
        for p in (self.part(name), self.sidecar(name)):
            p.unlink(missing_ok=True)
