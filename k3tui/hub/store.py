"""The local side of a download: where partials, sidecars and verification records live.

Layout inside the target folder (all on one filesystem, so the final rename is atomic):

    <name>                              a verified file, in place
    .k3tui/partial/<name>.part          bytes received so far
    .k3tui/partial/<name>.part.json     sidecar: expected digest, size, commit, etag, the
                                        range grid (bytes per range)
    .k3tui/partial/<name>.part.map      per range, 8 bytes (little-endian): bytes on disk
                                        from the range's start
    .k3tui/verified.json                {name: {size, mtime_ns, digest, commit}}: a file whose
                                        size and mtime still match is not re-hashed
    .k3tui/mismatch.json                {name: {expected, got}}: the last digest a file arrived
                                        with when it did not match the Hub's
    .k3tui/corrupt/<name>               a file that arrived with the same wrong digest twice,
                                        kept for inspection
    .k3tui/download.lock                flock of the one download job working on this folder
                                        (its pid and command inside), whatever its $K3TUI_HOME

Every Hub file name becomes a path through `LocalStore.path()` only: the Hub (or a mirror at
HF_ENDPOINT) is not trusted to name files inside the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from pathlib import Path

from k3tui.errors import K3Error
from k3tui.hub.metadata import RemoteFile

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


META = ".k3tui"


def check_writable(target: Path) -> None:
    """Refuse, before anything is fetched, a folder no download could be written to (a
    pseudo filesystem like /proc, a read-only mount, another user's folder): a folder is
    made and removed where the target would be, leaving nothing behind."""
    target = Path(target).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise K3Error(f"{target} is a file, not a folder.", "choose a folder with --dir", 2)
    parent = target
    while not parent.exists():
        parent = parent.parent
    try:
        probe = tempfile.mkdtemp(prefix=".k3tui-probe-", dir=parent)
        os.rmdir(probe)
    except OSError as exc:
        raise K3Error(f"{target} cannot hold a download: a folder cannot be made in {parent} "
                      f"({exc.strerror}).",
                      "choose a folder on a local disk you can write to with --dir", 2) from None


def name_problem(name: str) -> str | None:
    """Why a file name from a Hub listing must not become a path, or None if it may: only
    plain relative POSIX paths, outside k3tui's own folder, are accepted."""
    if not name:
        return "is empty"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        return "contains a control character"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/"):
        return "is an absolute path"
    if re.match(r"[A-Za-z]:", name):
        return "is a drive path"
    parts = name.split("/")
    if ".." in parts:
        return "climbs out of its folder with '..'"
    if "" in parts or "." in parts:
        return "has an empty or '.' component"
    if parts[0] == META:
        return f"would overwrite k3tui's own {META}/ folder"
    return None


class UnsafeName(K3Error):
    """A Hub file name that would not stay inside the target folder."""

    def __init__(self, root: Path, name: str, why: str):
        super().__init__(f"The Hub's file list names {name!r}, which {why}, so the whole "
                         f"download into {root} is refused.",
                         "check the repo and HF_ENDPOINT (only use a mirror you trust), or "
                         "choose another --dir if the folder holds a symlink leading out", 2)
        self.name = name


class LocalStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.meta = self.root / META
        self._lock = threading.Lock()

    def path(self, name: str, base: Path | None = None, suffix: str = "") -> Path:
        """The one place a Hub file name becomes a path: `base/name+suffix` (base: the
        folder). UnsafeName unless the name is a plain relative path and the result, with
        the symlinks that exist now resolved, stays inside the folder."""
        why = name_problem(name)
        path = (base or self.root) / f"{name}{suffix}"
        if why is None:
            try:
                real = path.resolve()
                inside = real.is_relative_to(self.root.resolve())
            except (OSError, RuntimeError):       # a symlink loop
                real, inside = path, False
            if not inside:
                why = f"leads outside the folder through a symlink (to {real})"
        if why is not None:
            raise UnsafeName(self.root, name, why)
        return path

    def check_names(self, names) -> None:
        """Refuse a listing up front if any of its names (or the paths derived from them)
        would leave the folder; the lock file too, since it is written in `.k3tui/`."""
        self.path("download.lock", self.meta)
        for name in names:
            self.final(name)
            self.part(name)
            self.sidecar(name)
            self.range_map(name)
            self.corrupt(name)

    def final(self, name: str) -> Path:
        return self.path(name)

    def part(self, name: str) -> Path:
        return self.path(name, self.meta / "partial", ".part")

    def sidecar(self, name: str) -> Path:
        return self.path(name, self.meta / "partial", ".part.json")

    def range_map(self, name: str) -> Path:
        return self.path(name, self.meta / "partial", ".part.map")

    def corrupt(self, name: str) -> Path:
        return self.path(name, self.meta / "corrupt")

    @property
    def lock_file(self) -> Path:
        return self.path("download.lock", self.meta)

    @property
    def records_file(self) -> Path:
        return self.meta / "verified.json"

    @property
    def mismatch_file(self) -> Path:
        return self.meta / "mismatch.json"

    def ensure(self) -> None:
        (self.meta / "partial").mkdir(parents=True, exist_ok=True)

    # -- verification records --------------------------------------------------------------
    def records(self) -> dict:
        return read_json(self.records_file) or {}

    def _update(self, path: Path, name: str, value: dict | None) -> None:
        """Set (or with None drop) one file's entry of a JSON record file."""
        with self._lock:
            recs = read_json(path) or {}
            if value is None and name not in recs:
                return
            if value is None:
                del recs[name]
            else:
                recs[name] = value
            atomic_write_json(path, recs)

    def record(self, name: str, size: int, mtime_ns: int, digest: str, commit: str) -> None:
        self._update(self.records_file, name, {"size": size, "mtime_ns": mtime_ns,
                                               "digest": digest, "commit": commit})

    def forget(self, name: str) -> None:
        self._update(self.records_file, name, None)

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

    # -- digests that did not match ----------------------------------------------------------
    def _mismatch(self, rf: RemoteFile) -> dict:
        rec = (read_json(self.mismatch_file) or {}).get(rf.name)
        ok = isinstance(rec, dict) and rec.get("expected") == expected_digest(rf)
        return rec if ok else {}

    def last_mismatch(self, rf: RemoteFile) -> str | None:
        """The digest `rf` last arrived with when it did not match the Hub's (for the same
        expected digest), or None."""
        return self._mismatch(rf).get("got") or None

    def known_corrupt(self, rf: RemoteFile) -> bool:
        """`rf` arrived twice with the same wrong digest: fetching it again would only
        repeat that (the copy is in `corrupt(name)`)."""
        return bool(self._mismatch(rf).get("twice"))

    def note_mismatch(self, rf: RemoteFile, got: str | None, twice: bool = False) -> None:
        """Remember the digest `rf` arrived with (None: forget it)."""
        self._update(self.mismatch_file, rf.name, None if got is None else
                     {"expected": expected_digest(rf), "got": got, "twice": twice})

    # -- partials ----------------------------------------------------------------------------
    def resume_state(self, rf: RemoteFile, grid: int) -> tuple[int, list[int]] | None:
        """(grid, bytes on disk per range) of a partial we may keep, or None: only if its
        sidecar is for the same content. Each range's count is clipped to the range and to
        the partial's size. A partial from before ranges (no map) is its size, from 0."""
        side = read_json(self.sidecar(rf.name))
        try:
            have = self.part(rf.name).stat().st_size
        except OSError:
            return None
        if not side or side.get("expected") != expected_digest(rf) or side.get("size") != rf.size:
            return None
        if "range_bytes" in side:
            grid = side["range_bytes"]
            if not isinstance(grid, int) or grid <= 0:
                return None
        cells = -(-rf.size // grid)
        try:
            raw = self.range_map(rf.name).read_bytes()
        except OSError:
            raw = b""
        if len(raw) == 8 * cells:
            counts = [int.from_bytes(raw[8 * k:8 * k + 8], "little") for k in range(cells)]
        elif "range_bytes" not in side:   # the contiguous prefix of an older k3tui
            counts = [max(0, min(have, rf.size) - k * grid) for k in range(cells)]
        else:
            return None                   # a map that is not ours: trust nothing
        return grid, [max(0, min(c, grid, rf.size - k * grid, have - k * grid))
                      for k, c in enumerate(counts)]

    def resumable_bytes(self, rf: RemoteFile, grid: int = 64 << 20) -> int:
        """Bytes of a partial we may keep (see resume_state)."""
        state = self.resume_state(rf, grid)
        return sum(state[1]) if state else 0

    def write_sidecar(self, rf: RemoteFile, commit: str, grid: int, etag: str = "") -> None:
        atomic_write_json(self.sidecar(rf.name), {
            "name": rf.name, "size": rf.size, "expected": expected_digest(rf),
            "commit": commit, "etag": etag, "range_bytes": grid})

    def discard_partial(self, name: str) -> None:
        """Forget a partial: its bytes (if still there), sidecar and range map."""
        for p in (self.part(name), self.sidecar(name), self.range_map(name)):
            p.unlink(missing_ok=True)
