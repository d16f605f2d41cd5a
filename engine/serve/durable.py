"""Kept conversation states on disk (`--state-dir`, `--state-gb`): a restart resumes them.

One file per state, `DIR/<owner>/<32 hex>.k3s` (owner: `snapshots.owner_of`'s digest, or
`local` without keys), written to a temporary file, fsynced and renamed, 0600 in 0700
folders. A file is

    b"K3STATE\\0" | header length (u32 LE) | sha256 of header + body | header | body

the header a small JSON object (the format, the checkpoint's fingerprint, the owner, the
ids, whether logits follow, every array's dtype and shape), the body the arrays raw and
little-endian in the model's layer order. Nothing in a file is trusted: at start-up each
header is read (bounded) and checked against the model's own shapes, and a state is read
whole and its checksum checked before it is used; a file that fails is refused with one
sentence on stderr (removed when it is this checkpoint's and format's, left alone when it
is another's). Only names this module makes are opened, never through a symlink, so
nothing outside the folder is read or written. Least recently used (by mtime, touched on
use) go first when the folder passes its budget; another checkpoint's states count too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from engine.checkpoint import trunk
from engine.checkpoint.safetensors import SafetensorsIndex
from engine.checkpoint.schema import TensorNames
from engine.core.config import ModelConfig
from engine.model.kda import KDAState
from engine.model.mla import MLAState
from engine.model.state import ModelState

FORMAT = "k3-state-1"  # bump when the layout or the meaning of a state changes
MAGIC = b"K3STATE\0"
PREFIX = struct.Struct("<8sI32s")
SUFFIX = ".k3s"
_NAME = re.compile(r"^[0-9a-f]{32}\.k3s$")
_OWNER = re.compile(r"^([0-9a-f]{64}|local)$")
_HEADER_KEYS = {"format", "fingerprint", "owner", "ids", "logits", "arrays"}
MAX_FILES = 4096  # a folder with more is not scanned further (the rest is ignored)


def checkpoint_fingerprint(checkpoint_dir: Path) -> str | None:
    """The identity states are tagged with: the trunk packer's fingerprint of the checkpoint
    (engine/checkpoint/trunk.py: config, shard sizes, trunk layout, sampled trunk bytes).
    None when it cannot be taken (a layout the packer refuses): states then stay in RAM."""
    try:
        index = SafetensorsIndex.open(checkpoint_dir)
        n = ModelConfig.from_dir(checkpoint_dir).num_hidden_layers
        runs = trunk.layer_runs(index, TensorNames.detect(index), n)
        return trunk.fingerprint(checkpoint_dir, index, runs)
    except Exception:  # noqa: BLE001 - any failure means: no durable states, said once
        return None


def _say(message: str) -> None:
    print(f"state folder: {message}", file=sys.stderr, flush=True)


class Refused(Exception):
    """A state file that is not a usable state of this model: the sentence says why."""


@dataclass
class _Entry:
    path: Path
    has_logits: bool


class StateDir:
    """The durable tier of `SnapshotStore`: `save`, `best` and `load`, all owners' states."""

    def __init__(self, root: Path, budget_bytes: int, fingerprint: str, template: ModelState,
                 vocab: int, n_ctx: int):
        self.root = root
        self.budget = max(0, int(budget_bytes))
        self.fingerprint = fingerprint
        self.vocab, self.n_ctx = vocab, n_ctx
        # ("mla", latent width) or ("kda", S's shape, {conv name: its shape})
        self._layers: list[tuple[Literal["mla"], int]
                           | tuple[Literal["kda"], tuple[int, ...], dict[str, tuple[int, ...]]]] = [
            ("mla", layer.latent.shape[1]) if isinstance(layer, MLAState)
            else ("kda", layer.S.shape, {p: h.shape for p, h in layer.conv.items()})
            for layer in template.layers
        ]
        self._index: dict[tuple[str, tuple[int, ...]], _Entry] = {}
        self._lock = threading.Lock()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(root)
        if not stat.S_ISDIR(info.st_mode):
            raise OSError(f"{root} is not a folder")
        if info.st_mode & 0o077:
            os.chmod(root, 0o700)
        self._scan()

    # -- what a state of this model looks like ----------------------------------------------
    def _arrays(self, n_ids: int, logits: bool) -> list[list[Any]]:
        """Every array's [dtype, shape] in body order, for a state covering `n_ids` ids."""
        out: list[list[Any]] = []
        for layer in self._layers:
            if layer[0] == "mla":
                out.append(["<f4", [n_ids, layer[1]]])
            else:
                out.append(["<f4", list(layer[1])])
                out += [["<f4", list(shape)] for shape in layer[2].values()]
        if logits:
            out.append(["<f4", [self.vocab]])
        return out

    @staticmethod
    def _body_bytes(arrays: list[list[Any]]) -> int:
        return sum(4 * int(np.prod(shape)) for _, shape in arrays)

    def _max_header(self) -> int:
        return 65536 + 12 * self.n_ctx

    # -- names --------------------------------------------------------------------------------
    def _folder(self, owner: str) -> Path:
        return self.root / (owner or "local")

    def _path(self, owner: str, ids: tuple[int, ...]) -> Path:
        h = hashlib.sha256(owner.encode() + b"\0" + np.asarray(ids, "<i8").tobytes())
        return self._folder(owner) / (h.hexdigest()[:32] + SUFFIX)

    def _files(self, say: bool = False) -> Iterator[tuple[Path, os.stat_result]]:
        """(path, lstat) of every regular state-named file; with `say`, a sentence for
        each state-named thing that is not one (a symlink)."""
        for folder in sorted(self.root.iterdir()):
            if not _OWNER.match(folder.name):
                continue
            info = os.lstat(folder)
            if not stat.S_ISDIR(info.st_mode):
                if say:
                    _say(f"{folder} is not a folder (a symlink?); ignored")
                continue
            for path in sorted(folder.iterdir()):
                if path.name.startswith(".") and path.name.endswith(".tmp"):
                    _remove_stale_tmp(path)
                    continue
                if not _NAME.match(path.name):
                    continue
                info = os.lstat(path)
                if not stat.S_ISREG(info.st_mode):
                    if say:
                        _say(f"{path} is not a regular file (a symlink?); ignored")
                    continue
                yield path, info

    # -- start-up -----------------------------------------------------------------------------
    def _scan(self) -> None:
        foreign = 0
        for n, (path, info) in enumerate(self._files(say=True)):
            if n >= MAX_FILES:
                _say(f"more than {MAX_FILES} files; the rest are ignored")
                break
            try:
                with _open_read(path) as f:
                    size = os.fstat(f.fileno()).st_size
                    header, raw, _ = self._read_header(f, size)
                owner, ids, logits = self._check_header(header, len(raw), path, size)
            except _Foreign:
                foreign += 1
                continue
            except Refused as exc:
                self._refuse(path, str(exc))
                continue
            except OSError as exc:
                _say(f"{path} could not be read ({exc.strerror or exc}); ignored")
                continue
            if path != self._path(owner, ids):
                self._refuse(path, "its name does not match its content")
                continue
            self._index[(owner, ids)] = _Entry(path, logits)
        if foreign:
            _say(f"{foreign} state file(s) of another checkpoint or format are kept but not "
                 "used (they go first when the folder needs room)")
        if self._index:
            _say(f"{len(self._index)} kept state(s) in {self.root}")

    def _read_header(self, f: io.BufferedReader, size: int) -> tuple[dict, bytes, bytes]:
        """The header of the open file `f` of `size` bytes: (parsed, raw, the checksum the
        file declares). Bounded: nothing past the header is read."""
        head = f.read(PREFIX.size)
        if len(head) < PREFIX.size:
            raise Refused("it is truncated")
        magic, n, digest = PREFIX.unpack(head)
        if magic != MAGIC:
            raise Refused("it is not a state file")
        if n > self._max_header() or PREFIX.size + n > size:
            raise Refused(f"its header declares {n} bytes")
        raw = f.read(n)
        if len(raw) != n:
            raise Refused("it is truncated")
        header = _parse(raw)
        if header.get("format") != FORMAT or header.get("fingerprint") != self.fingerprint:
            raise _Foreign()
        return header, raw, digest

    def _check_header(self, header: dict, n: int, path: Path, size: int
                      ) -> tuple[str, tuple[int, ...], bool]:
        if set(header) != _HEADER_KEYS:
            raise Refused("its header has other fields than a state's")
        owner, ids, logits = header["owner"], header["ids"], header["logits"]
        if not isinstance(owner, str) or (owner or "local") != path.parent.name:
            raise Refused("it is not in its owner's folder")
        if not (isinstance(ids, list) and 0 < len(ids) <= self.n_ctx and all(
                type(i) is int and 0 <= i < self.vocab for i in ids)):
            raise Refused(f"its ids are not 1 to {self.n_ctx} token ids of this model")
        if not isinstance(logits, bool):
            raise Refused("its logits flag is not true or false")
        want = self._arrays(len(ids), logits)
        if header["arrays"] != want:
            raise Refused("its arrays are not this model's (dtype or shape)")
        if size != PREFIX.size + n + self._body_bytes(want):
            raise Refused(f"it is {size} bytes, not the size its header declares "
                          "(truncated or padded)")
        return owner, tuple(ids), logits

    def _refuse(self, path: Path, why: str) -> None:
        _say(f"{path} is refused: {why}; it is removed (the state is prefilled again)")
        try:
            os.unlink(path)
        except OSError:
            pass

    # -- use ----------------------------------------------------------------------------------
    def best(self, prompt_ids: list[int], owner: str, longer_than: int) -> tuple[int, ...] | None:
        """The ids of `owner`'s longest state on disk that starts `prompt_ids` (all of them
        only with logits) and covers more than `longer_than` ids, or None."""
        best = None
        with self._lock:
            for (who, ids), entry in self._index.items():
                n = len(ids)
                fits = n < len(prompt_ids) or (n == len(prompt_ids) and entry.has_logits)
                if (who == owner and fits and n > (len(best) if best else longer_than)
                        and list(ids) == prompt_ids[:n]):
                    best = ids
        return best

    def has(self, owner: str, ids: tuple[int, ...]) -> bool:
        with self._lock:
            return (owner, ids) in self._index

    def load(self, owner: str, ids: tuple[int, ...]) -> ModelState | None:
        """The state, read whole and checked; None (and the file refused) when it fails."""
        with self._lock:
            entry = self._index.get((owner, ids))
        if entry is None:
            return None
        try:
            state = self._read_state(entry.path, owner, ids)
            os.utime(entry.path, follow_symlinks=False)  # recently used
            return state
        except (Refused, OSError, ValueError) as exc:
            with self._lock:
                self._index.pop((owner, ids), None)
            why = str(exc) if isinstance(exc, Refused) else f"unreadable ({exc})"
            self._refuse(entry.path, why)
            return None

    def _read_state(self, path: Path, owner: str, ids: tuple[int, ...]) -> ModelState:
        with _open_read(path) as f:
            size = os.fstat(f.fileno()).st_size
            try:
                header, raw, digest = self._read_header(f, size)
            except _Foreign:
                raise Refused("it is now another checkpoint's or format's state") from None
            n = len(raw)
            got = self._check_header(header, n, path, size)
            if got[:2] != (owner, ids):
                raise Refused("it no longer holds the state it was indexed as")
            body = bytearray(size - PREFIX.size - n)  # the size the header declares
            if f.readinto(body) != len(body) or f.read(1):
                raise Refused("it changed while it was read")
        check = hashlib.sha256(raw)
        check.update(body)
        if check.digest() != digest:
            raise Refused("its checksum does not match (corrupt)")
        arrays, off = [], 0
        for _, shape in header["arrays"]:
            count = int(np.prod(shape))
            # views of the one buffer read (writable, 4-byte aligned): no second copy
            view = np.frombuffer(body, "<f4", count, off).reshape(shape)
            arrays.append(view.astype(np.float32, copy=False))
            off += 4 * count
        layers: list[KDAState | MLAState] = []
        it = iter(arrays)
        for layer in self._layers:
            if layer[0] == "mla":
                latent = next(it)
                layers.append(MLAState(latent, latent.shape[0]))
            else:
                layers.append(KDAState(next(it), {p: next(it) for p in layer[2]}))
        return ModelState(layers, len(ids), list(ids), next(it) if got[2] else None)

    def save(self, state: ModelState, owner: str) -> bool:
        """Write `state` for `owner` (atomically), making room first. False (with a
        sentence) when it cannot: too large for the budget, a full disk."""
        ids = tuple(int(i) for i in state.ids)
        arrays = self._state_arrays(state)
        want = self._arrays(len(ids), state.logits is not None)
        if arrays is None or [["<f4", list(a.shape)] for a in arrays] != want:
            return False  # not a state of the shape this folder checks (never expected)
        header = json.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "owner": owner,
                             "ids": list(ids), "logits": state.logits is not None,
                             "arrays": want}, separators=(",", ":")).encode()
        size = PREFIX.size + len(header) + self._body_bytes(want)
        if size > self.budget or len(ids) > self.n_ctx:
            return False
        path = self._path(owner, ids)
        with self._lock:
            self._make_room(size, keep=path)
        digest = hashlib.sha256(header)
        for a in arrays:
            digest.update(a.data.cast("B"))
        folder = path.parent
        tmp = folder / f".{path.stem}.{os.getpid()}.tmp"
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                raise OSError(f"{folder} is not a folder (a symlink?)")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(PREFIX.pack(MAGIC, len(header), digest.digest()))
                f.write(header)
                for a in arrays:
                    f.write(a.data.cast("B"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(folder)
        except OSError as exc:
            _say(f"a state could not be saved ({exc.strerror or exc}); it stays in memory only")
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            self._index[(owner, ids)] = _Entry(path, state.logits is not None)
        return True

    def touch(self, owner: str, ids: tuple[int, ...]) -> None:
        with self._lock:
            entry = self._index.get((owner, ids))
        if entry is not None:
            try:
                os.utime(entry.path, follow_symlinks=False)
            except OSError:
                pass

    def drop(self, owner: str, ids: tuple[int, ...]) -> None:
        with self._lock:
            entry = self._index.pop((owner, ids), None)
        if entry is not None:
            try:
                os.unlink(entry.path)
            except OSError:
                pass

    @staticmethod
    def _state_arrays(state: ModelState) -> list[np.ndarray] | None:
        out = []
        for layer in state.layers:
            if isinstance(layer, MLAState):
                out.append(layer.latent[: layer.length])
            else:
                out += [layer.S, *(layer.conv[p] for p in sorted(layer.conv, key="qkv".index))]
        if state.logits is not None:
            out.append(state.logits)
        if any(a.dtype != np.float32 for a in out):
            return None
        return [np.ascontiguousarray(a, "<f4") for a in out]

    def _make_room(self, size: int, keep: Path) -> None:
        """Remove the least recently used files (any checkpoint's) until `size` fits."""
        files = []
        for path, info in self._files():
            if path != keep:
                files.append((info.st_mtime_ns, info.st_size, path))
        used = sum(s for _, s, _ in files)
        for _, s, path in sorted(files):
            if used + size <= self.budget:
                break
            try:
                os.unlink(path)
            except OSError:
                continue
            used -= s
            for key, entry in list(self._index.items()):
                if entry.path == path:
                    del self._index[key]

    def usage(self) -> tuple[int, int]:
        """(files, bytes) in the folder."""
        sizes = [info.st_size for _, info in self._files()]
        return len(sizes), sum(sizes)


class _Foreign(Exception):
    """Another checkpoint's or format's state: kept, not used."""


def _parse(raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Refused("its header is not JSON") from None
    if not isinstance(header, dict):
        raise Refused("its header is not a JSON object")
    return header


def _open_read(path: Path) -> io.BufferedReader:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused("it is not a regular file")
    return os.fdopen(fd, "rb")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_tmp(path: Path) -> None:
    """A temporary file a killed writer left (its pid is gone) is removed."""
    try:
        pid = int(path.name.rsplit(".", 2)[-2])
        os.kill(pid, 0)
        return  # the writer still runs
    except (ValueError, IndexError):
        pass
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    try:
        os.unlink(path)
    except OSError:
        pass
