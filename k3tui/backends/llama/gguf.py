"""GGUF files: the header fields k3tui reads, and the shard set of a split model."""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from k3tui.errors import K3Error
from k3tui.units import GiB, MiB


SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


# ggml type id -> (elements per block, bytes per block); from the GGUF spec (gguf-py constants).
GGML_BLOCK: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66),
    39: (32, 17), 40: (64, 36), 41: (128, 18),
}
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32",
               6: "float32", 7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64",
               12: "float64"}
_INTEGER = (0, 1, 2, 3, 4, 5, 10, 11)

# Bounds of a header that can be trusted: a real GGUF stays far inside each of them.
MAX_KEY = 65_535           # the GGUF spec's limit for a key
MAX_STRING = 64 * MiB      # a chat template is kilobytes; more is not a model's header
MAX_DEPTH = 4              # arrays of arrays nested deeper than this (real files: 1)
MAX_DIMS = 8               # ggml has 4
MAX_COUNT = 1 << 24        # keys, tensors, strings in one array: each is read one by one
_USED = ("general.alignment", "split.no", "split.count")   # the values kept


class GGUFError(ValueError):
    """A header field that no real GGUF has; the message names the field."""


@dataclass
class GGUFHeader:
    path: Path
    split_no: int | None
    split_count: int | None
    expected_size: int | None  # None when a tensor type is unknown to us
    n_tensors: int
    block_count: int | None = None  # the model's layers, as its architecture's metadata says


class _Reader:
    """Reads a GGUF header with every length, count and nesting checked against the file's
    size and the bounds above before anything is allocated or skipped."""

    def __init__(self, fh: BinaryIO, size: int):
        self.fh, self.size = fh, size

    def rest(self) -> int:
        return self.size - self.fh.tell()

    def take(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        raw = self.fh.read(n)
        if len(raw) != n:
            raise GGUFError(f"the file ends inside {what}")
        return struct.unpack(fmt, raw)[0]

    def count(self, what: str, each: int, most: int | None = MAX_COUNT) -> int:
        """A u64 count of things of at least `each` bytes that must fit in the rest (and,
        when they are read one by one, number at most `most`)."""
        n = self.take("<Q", what)
        if n * each > self.rest():
            raise GGUFError(f"{what} is {n:,}, more than the {self.rest():,} bytes left in "
                            "the file can hold")
        if most is not None and n > most:
            raise GGUFError(f"{what} is {n:,}, more than the {most:,} k3tui reads")
        return n

    def string(self, what: str, most: int = MAX_STRING, keep: bool = True) -> str:
        n = self.take("<Q", f"the length of {what}")
        if n > min(most, self.rest()):
            raise GGUFError(f"{what} is {n:,} bytes long, more than "
                            + (f"the {self.rest():,} left in the file" if n <= most
                               else f"the {most:,} a GGUF header allows"))
        if not keep:
            self.fh.seek(n, 1)
            return ""
        return self.fh.read(n).decode("utf-8", "replace")

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        """(kind, value) of a value of GGUF type `kind`; strings and arrays are skipped
        (their value is None)."""
        if kind == 8:
            self.string(what, keep=False)
            return kind, None
        if kind == 9:
            if depth >= MAX_DEPTH:
                raise GGUFError(f"{what} nests arrays more than {MAX_DEPTH} deep")
            sub = self.take("<I", f"the element type of {what}")
            if sub not in _TYPE_NAMES:
                raise GGUFError(f"{what} is an array of type {sub}, which GGUF does not "
                                "define")
            scalar = sub in _SCALAR
            each = struct.calcsize(_SCALAR[sub]) if scalar else 8
            n = self.count(f"the length of the array {what}", each, None if scalar else MAX_COUNT)
            if scalar:
                self.fh.seek(each * n, 1)
            else:
                for _ in range(n):
                    self.value(sub, what, depth + 1)
            return kind, None
        if kind not in _SCALAR:
            raise GGUFError(f"{what} has value type {kind}, which GGUF does not define")
        return kind, self.take(_SCALAR[kind], what)


def _quoted(name: str) -> str:
    """A name from the file as a message shows it: quoted, control characters escaped, cut."""
    return repr(name if len(name) <= 60 else name[:60] + "…")


def _integer(kv: dict, key: str, low: int, high: int) -> int | None:
    """An integer-typed header value within [low, high], None when absent."""
    if key not in kv:
        return None
    kind, value = kv[key]
    if kind not in _INTEGER or not low <= value <= high:
        what = f"a {_TYPE_NAMES[kind]}" if value is None else \
            f"the {_TYPE_NAMES[kind]} {value!r}"
        raise GGUFError(f"{key} is {what}, not an integer from {low:,} to {high:,}")
    return value


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the header and tensor table; the expected file size ends at the last tensor.
    GGUFError (a ValueError naming the field) for anything no real GGUF holds."""
    with open(path, "rb", buffering=MiB) as fh:
        r = _Reader(fh, os.fstat(fh.fileno()).st_size)
        if fh.read(4) != b"GGUF":
            raise GGUFError("not a GGUF file (bad magic)")
        version = r.take("<I", "the version")
        if version < 2:
            raise GGUFError(f"GGUF version {version} is too old")
        n_tensors = r.count("the number of tensors", 8 + 4 + 4 + 8)
        n_kv = r.count("the number of keys", 8 + 4 + 1)
        kv: dict[str, tuple[int, Any]] = {}
        for i in range(n_kv):
            key = r.string(f"key {i}", MAX_KEY)
            value = r.value(r.take("<I", f"the type of {_quoted(key)}"), _quoted(key))
            if key in _USED or key.endswith(".block_count"):
                kv[key] = value
        end = 0
        known = True
        for i in range(n_tensors):
            name = _quoted(r.string(f"the name of tensor {i}", MAX_KEY))
            n_dims = r.take("<I", f"the dimensions of tensor {name}")
            if n_dims > MAX_DIMS:
                raise GGUFError(f"tensor {name} has {n_dims:,} dimensions (ggml has "
                                f"at most {MAX_DIMS})")
            dims = [r.take("<Q", f"the shape of tensor {name}") for _ in range(n_dims)]
            ggml_type, offset = r.take("<I", f"the type of tensor {name}"), \
                r.take("<Q", f"the offset of tensor {name}")
            block = GGML_BLOCK.get(ggml_type)
            if block is None:
                known = False
                continue
            n = 1
            for d in dims:
                n *= d
            end = max(end, offset + n // block[0] * block[1])
        align = _integer(kv, "general.alignment", 1, GiB) or 32
        if align & (align - 1):
            raise GGUFError(f"general.alignment is {align:,}, not a power of two")
        data_start = -(-fh.tell() // align) * align
    no = _integer(kv, "split.no", 0, 65_535)
    count = _integer(kv, "split.count", 0, 65_535)
    # `<architecture>.block_count`: the layers, which llama.cpp deals out over RPC workers.
    blocks = next((_integer(kv, k, 1, 65_535) for k in kv if k.endswith(".block_count")), None)
    return GGUFHeader(path, no, count, data_start + end if known else None, n_tensors, blocks)


def model_shards(model: Path) -> list[Path]:
    """Every file of a (possibly split) GGUF given any shard or the folder; first shard first."""
    model = Path(model).expanduser()
    if model.is_dir():
        ggufs = sorted(model.glob("*.gguf"))
        firsts = [p for p in ggufs if (m := SPLIT_RE.match(p.name)) and int(m["no"]) == 1]
        singles = [p for p in ggufs if not SPLIT_RE.match(p.name)]
        choices = firsts + singles
        later = [m for p in ggufs if (m := SPLIT_RE.match(p.name)) and int(m["no"]) != 1]
        if not choices and later:  # a split model whose first shard is missing
            first = f"{later[0]['prefix']}-00001-of-{int(later[0]['count']):05d}.gguf"
            raise K3Error(f"{model} holds {len(later)} shards of a split GGUF but not its "
                          f"first shard, {first}.",
                          "run `k3tui download` to fetch (or resume) it, then start again")
        if len(choices) != 1:
            raise K3Error(f"{model} holds {len(choices) or 'no'} GGUF models"
                          + (f" ({', '.join(p.name for p in choices)})" if choices else "") + ".",
                          "point the config at the .gguf file to serve "
                          "(`k3tui config set model.dir FILE.gguf`)")
        model = choices[0]
    m = SPLIT_RE.match(model.name)
    if not m:
        return [model]
    count = int(m["count"])
    return [model.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def check_shards(model: Path) -> list[Path]:
    """Refuse a split GGUF with a missing or short shard *before* launching anything."""
    shards = model_shards(model)
    missing = [p for p in shards if not p.is_file()]
    if missing and len(shards) == 1:
        raise K3Error(f"The GGUF model {shards[0]} does not exist.",
                      "point the config at the .gguf file "
                      "(`k3tui config set model.dir FILE.gguf`), or run `k3tui download`")
    if missing:
        names = ", ".join(p.name for p in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise K3Error(f"{len(missing)} of {len(shards)} GGUF shards are missing in "
                      f"{shards[0].parent}: {names}.",
                      "run `k3tui download` to fetch (or resume) them, then start again")
    problems: list[str] = []
    for p in shards:
        try:
            head = read_gguf_header(p)
        except GGUFError as exc:
            problems.append(f"{p.name} has an unreadable header ({exc})")
            continue
        except OSError as exc:
            problems.append(f"{p.name} cannot be read ({exc.strerror or exc})")
            continue
        size = p.stat().st_size
        if head.expected_size is not None and size < head.expected_size:
            problems.append(f"{p.name} is {size:,} bytes but its tensors need "
                            f"{head.expected_size:,}")
        if len(shards) > 1 and head.split_count not in (None, len(shards)):
            problems.append(f"{p.name} says it is one of {head.split_count} shards, "
                            f"not {len(shards)}")
    if problems:
        raise K3Error("The GGUF model is incomplete or damaged: " + "; ".join(problems[:3])
                      + ".", "run `k3tui download` to resume the download (with --verify "
                      "--rehash to check every file against the Hub), then start again")
    return shards


