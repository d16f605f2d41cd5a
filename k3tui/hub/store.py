"""The local side of a download: where partials, sidecars and verification records live.

Layout inside the target folder (all on one filesystem, so the final rename is atomic):

    <name>                              a verified file, in place
    .k3tui/partial/<name>.part          bytes received so far
    .k3tui/partial/<name>.part.json     sidecar: expected digest, size, commit, etag, the
                                        range grid (bytes per range)
    .k3tui/partial/<name>.part.map      per range, 8 bytes (little-endian): bytes on disk
                                        from the range's start
    .k3tui/records.jsonl                the folder's records (`Journal`), one JSON line each:
                                        the repo and revision it holds; per verified file
                                        {size, mtime_ns, digest, commit} (a file whose size and
                                        mtime still match is not re-hashed); the last digest a
                                        file arrived with when it did not match the Hub's
    .k3tui/corrupt/<name>               a file that arrived with the same wrong digest twice,
                                        kept for inspection
    .k3tui/download.lock                flock of the one download job working on this folder
                                        (its pid and command inside), whatever its $K3TUI_HOME

Every Hub file name becomes a path through `LocalStore.path()` only: the Hub (or a mirror at
HF_ENDPOINT) is not trusted to name files inside the folder.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
from pathlib import Path

from k3tui.errors import K3Error
from k3tui.hub.metadata import RemoteFile, RepoSnapshot
from k3tui.units import KiB

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


JOURNAL = "records.jsonl"
MAX_LINE = 64 * KiB       # longer than any record we write: such a line is skipped, not read
COMPACT_SLACK = 1024      # superseded lines tolerated beyond as many as are live

# The one schema of a journal line: its op and each field's type (nothing else is applied).
_OPS: dict[str, dict[str, type]] = {
    "origin": {"repo": str, "revision": str, "commit": str},
    "verified": {"name": str, "size": int, "mtime_ns": int, "digest": str, "commit": str},
    "forget": {"name": str},
    "mismatch": {"name": str, "expected": str, "got": str, "twice": bool},
    "clear": {"name": str},
}


def _valid(entry: object) -> dict | None:
    """`entry` as one of `_OPS` (only its fields), or None when it is not one (damage)."""
    op = entry.get("op") if isinstance(entry, dict) else None
    fields = _OPS.get(op) if isinstance(op, str) else None
    if fields is None:
        return None
    for key, tp in fields.items():
        value = entry.get(key)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            return None
    return {"op": op, **{key: entry[key] for key in fields}}


def _line(entry: dict) -> str:
    return json.dumps(entry, separators=(",", ":")) + "\n"


class Journal:
    """A folder's records: the repo and revision it holds, each verified file, and digests
    that arrived wrong, as an append-only file of JSON lines read once.

    A change is one appended line (never a rewrite of the others), so the bookkeeping of a
    file costs the same whether the listing has 10 files or 100,000. Once superseded lines
    outnumber the live ones (plus COMPACT_SLACK), the live state is rewritten whole (tmp,
    fsync, rename): O(1) per change on average. A kill -9 loses at most the line being
    written: a line counts only with its newline, a damaged line is skipped, and the torn tail
    is cut off before this process appends. One writer at a time (the folder's download lock).
    """

    def __init__(self, path: Path, legacy: tuple[Path, Path] = ()):
        self.path, self.legacy = path, legacy
        self.origin: dict | None = None
        self.verified: dict[str, dict] = {}
        self.mismatch: dict[str, dict] = {}
        self.lines = 0                  # lines in the file, live or superseded
        self.end = 0                    # bytes up to the end of its last whole line
        self.bytes_read = self.bytes_written = 0   # the work done, for the tests to count
        self._fd = -1
        self._lock = threading.Lock()
        self._migrate = False           # state read from an older k3tui's JSON files
        self._load()

    def _load(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            self._load_legacy()
            return
        except OSError:
            return                      # unreadable: nothing is trusted, files are re-hashed
        with open(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return                  # a fifo or a device is not our journal
            while line := fh.readline(MAX_LINE):
                size, tail = len(line), line
                while not tail.endswith(b"\n") and (tail := fh.readline(MAX_LINE)):
                    size += len(tail)   # an overlong line: read to its end, never held
                self.bytes_read += size
                if not tail.endswith(b"\n"):
                    break               # the torn last line of a killed writer
                self.end += size
                self.lines += 1
                if tail is line:
                    try:
                        entry = _valid(json.loads(line))
                    except (ValueError, RecursionError):
                        entry = None
                    if entry is not None:
                        self._apply(entry)

    def _load_legacy(self) -> None:
        """verified.json and mismatch.json of an older k3tui: the same facts, checked the
        same way; written into the journal (and removed) on the first change."""
        for path, op in zip(self.legacy, ("verified", "mismatch")):
            for name, rec in (read_json(path) or {}).items():
                if isinstance(rec, dict):
                    extra = {"twice": False} if op == "mismatch" else {}
                    if (entry := _valid({**extra, **rec, "op": op, "name": name})):
                        self._apply(entry)
                        self._migrate = True

    def _apply(self, entry: dict) -> None:
        op, name = entry.pop("op"), entry.pop("name", None)
        if op == "origin":
            self.origin = entry
        elif op == "verified":
            self.verified[name] = entry
        elif op == "forget":
            self.verified.pop(name, None)
        elif op == "mismatch":
            self.mismatch[name] = entry
        else:
            self.mismatch.pop(name, None)

    def _live(self) -> list[dict]:
        out = [{"op": "origin", **self.origin}] if self.origin else []
        out += [{"op": "verified", "name": n, **r} for n, r in self.verified.items()]
        return out + [{"op": "mismatch", "name": n, **r} for n, r in self.mismatch.items()]

    def append(self, entry: dict) -> None:
        """Apply one change and append its line. OSError (a full disk) changes nothing."""
        line = _line(entry).encode()
        with self._lock:
            live = bool(self.origin) + len(self.verified) + len(self.mismatch)
            if self._migrate or self.lines > 2 * live + COMPACT_SLACK:
                self._compact()
            elif self._fd < 0:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT |
                                   os.O_NOFOLLOW, 0o644)
                if os.fstat(self._fd).st_size != self.end:
                    os.ftruncate(self._fd, self.end)      # the torn tail of a killed writer
            try:
                n = os.write(self._fd, line)
                if n != len(line):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            except OSError:
                os.ftruncate(self._fd, self.end)   # never leave half a line to append after
                raise
            self.end += n
            self.lines += 1
            self.bytes_written += n
            self._apply(dict(entry))

    def _compact(self) -> None:
        """Rewrite the live state whole; a kill leaves the old file or the new one."""
        data = "".join(map(_line, self._live())).encode()
        tmp = self.path.with_name(f".{self.path.name}.tmp")   # one writer: one name
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        self.lines, self.end = len(self._live()), len(data)
        self.bytes_written += len(data)
        if self._migrate:
            for old in self.legacy:
                old.unlink(missing_ok=True)
            self._migrate = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.meta = self.root / META
        self._lock = threading.Lock()
        self._journal: Journal | None = None
        self._dirs: dict[str | None, str] | None = None   # see resolving_once

    def path(self, name: str, base: Path | None = None, suffix: str = "") -> Path:
        """The one place a Hub file name becomes a path: `base/name+suffix` (base: the
        folder). UnsafeName unless the name is a plain relative path and the result, with
        the symlinks that exist now resolved, stays inside the folder."""
        why = name_problem(name)
        path = (base or self.root) / f"{name}{suffix}"
        if why is None:
            try:
                real = self._resolve(path)
                root = self._dirs.get(None) if self._dirs is not None else None
                if root is None:
                    root = str(self.root.resolve())
                    if self._dirs is not None:
                        self._dirs[None] = root     # the folder itself
                inside = real == root or real.startswith(os.path.join(root, ""))
            except (OSError, RuntimeError):       # a symlink loop
                real, inside = path, False
            if not inside:
                why = f"leads outside the folder through a symlink (to {real})"
        if why is not None:
            raise UnsafeName(self.root, name, why)
        return path

    def _resolve(self, path: Path) -> str:
        """`path.resolve()`; within `resolving_once`, each folder is resolved once."""
        if self._dirs is None or os.path.islink(path):
            return str(path.resolve())
        head, tail = os.path.split(path)
        if (parent := self._dirs.get(head)) is None:
            parent = self._dirs[head] = str(Path(head).resolve())
        return os.path.join(parent, tail)

    @contextlib.contextmanager
    def resolving_once(self):
        """Within: the folders' real paths are resolved once (planning 100,000 names would
        otherwise walk the same folders 700,000 times); after it, every path is resolved
        anew, so a symlink made later is still seen before anything is written there."""
        self._dirs = {}
        try:
            yield
        finally:
            self._dirs = None

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
    def journal_file(self) -> Path:
        return self.meta / JOURNAL

    def ensure(self) -> None:
        (self.meta / "partial").mkdir(parents=True, exist_ok=True)

    @property
    def journal(self) -> Journal:
        """The folder's records, read from disk once (on first use)."""
        with self._lock:
            if self._journal is None:
                self._journal = Journal(self.journal_file,
                                        (self.meta / "verified.json", self.meta / "mismatch.json"))
            return self._journal

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()

    # -- which repo the folder holds -------------------------------------------------------
    def check_origin(self, snap: RepoSnapshot) -> str | None:
        """Refuse a folder that holds another repo (their same-named files would replace each
        other and the mixture pass as verified); for another revision of the same repo, the
        line that says it is updated in place. None: the folder is new or holds this commit."""
        held = self.journal.origin
        if held is None:
            return None
        if held["repo"].casefold() != snap.repo.casefold():
            owner, name = snap.repo.split("/", 1)
            other = self.root.parent / (name if name != self.root.name else f"{owner}-{name}")
            raise K3Error(f"{self.root} already holds {held['repo']} ({held['revision']} @ "
                          f"{held['commit'][:12]}), so {snap.repo} is not downloaded into it: "
                          "the two repos' files would mix.",
                          f"give {snap.repo} a folder of its own, e.g. --dir {other}", 2)
        if held["commit"] == snap.commit:
            return None
        return (f"{self.root} holds {held['repo']} @ {held['commit'][:12]} "
                f"({held['revision']}); it is updated to {snap.commit[:12]} ({snap.revision}): "
                "files that changed are fetched again, the others are kept.")

    def claim(self, snap: RepoSnapshot) -> None:
        """Record that the folder holds `snap` (before any of its bytes are written);
        K3Error if it holds another repo. The revision the user named stays recorded when a
        job asks for the same commit by its hash."""
        self.check_origin(snap)
        held = self.journal.origin
        if held is None or (held["repo"], held["commit"]) != (snap.repo, snap.commit):
            self.journal.append({"op": "origin", "repo": snap.repo, "revision": snap.revision,
                                 "commit": snap.commit})

    # -- verification records --------------------------------------------------------------
    def record(self, name: str, size: int, mtime_ns: int, digest: str, commit: str) -> None:
        self.journal.append({"op": "verified", "name": name, "size": size,
                             "mtime_ns": mtime_ns, "digest": digest, "commit": commit})

    def forget(self, name: str) -> None:
        if name in self.journal.verified:
            self.journal.append({"op": "forget", "name": name})

    def recorded_ok(self, rf: RemoteFile, final: Path, mtime: bool = True) -> bool:
        """The final file (`final(rf.name)`) is what we verified last time: same digest and
        size (and mtime)."""
        rec = self.journal.verified.get(rf.name)
        if not rec:
            return False
        try:
            st = final.stat()
        except OSError:
            return False
        return rec["digest"] == expected_digest(rf) and rec["size"] == st.st_size == rf.size \
            and (not mtime or rec["mtime_ns"] == st.st_mtime_ns)

    # -- digests that did not match ----------------------------------------------------------
    def _mismatch(self, rf: RemoteFile) -> dict:
        rec = self.journal.mismatch.get(rf.name)
        return rec if rec and rec["expected"] == expected_digest(rf) else {}

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
        if got is not None:
            self.journal.append({"op": "mismatch", "name": rf.name,
                                 "expected": expected_digest(rf), "got": got, "twice": twice})
        elif rf.name in self.journal.mismatch:
            self.journal.append({"op": "clear", "name": rf.name})

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
