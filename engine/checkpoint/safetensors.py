"""A checked index over safetensors files: tensor name → file, absolute offset, dtype, shape.

Format: 8-byte little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets: [start, end]}}` (offsets relative to the end of the header, optional
`__metadata__`), then the raw bytes. Every structural problem (a header that points
outside its file, overlapping tensors, a truncated shard, a tensor the index names but
no file holds) is refused with the file and tensor named, before any math runs.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import CheckpointError
from engine.jsonfile import load_json, parse_json

# Raw on-disk dtypes; BF16 is handed out as uint16 and widened by the kernels.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # the format's own limit; the real checkpoint's largest is a few MB
MAX_INDEX = 256 << 20  # the release's index.json (~500k tensors) is tens of MB


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    offset: int  # absolute byte offset in file
    nbytes: int
    dtype: str  # "BF16" | "F32" | "F16" | "U8" ...
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors file's header."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(
                    f"{file} is {size} bytes, too short to be a safetensors file; "
                    "re-download it."
                )
            (n,) = struct.unpack("<Q", raw_len)
            if n > MAX_HEADER:
                raise CheckpointError(
                    f"{file}: its header claims {n} bytes, over the format's limit of "
                    f"{MAX_HEADER / 1e6:g} MB; the file is corrupt or not safetensors; "
                    "re-download it."
                )
            if 8 + n > size:
                raise CheckpointError(
                    f"{file}: its header claims {n} bytes but the file holds {size}; the file is "
                    "truncated or not safetensors; re-download it."
                )
            header_bytes = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read {file} ({exc.strerror}); check the path.") from None
    header = parse_json(header_bytes, f"{file}'s header", "re-download the file.")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        meta = meta if isinstance(meta, dict) else {}
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        for key, value, count in (("shape", shape, None), ("data_offsets", offsets, 2)):
            if not _naturals(value, count):
                raise CheckpointError(
                    f"{file}: tensor {name}'s {key} is {_short(value)}, not "
                    f"{'[start, end]' if count else 'a list'} of non-negative integers; the "
                    "header is corrupt; re-download the file."
                )
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(
                f"{file}: tensor {name} has dtype {_short(dtype)}, not one of "
                f"{', '.join(DTYPES)}; the header is corrupt or from another format; "
                "re-download the file."
            )
        shape = tuple(shape)
        start, end = offsets
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - start != want:
            raise CheckpointError(
                f"{file}: tensor {name} spans bytes [{start}, {end}) but dtype {dtype} shape "
                f"{list(shape)} needs {want} bytes; the header is corrupt; re-download the file."
            )
        if base + end > size:
            raise CheckpointError(
                f"{file}: tensor {name} ends at byte {base + end} but the file holds only {size} "
                "bytes (truncated shard or header pointing outside the file); re-download it."
            )
        out[name] = TensorInfo(name, file, base + start, want, dtype, shape)
    clash = overlap([(t.offset, t.end, t) for t in out.values()])
    if clash:
        a, b = clash
        raise CheckpointError(
            f"{file}: tensors {a.name} and {b.name} overlap (bytes [{a.offset}, {a.end}) and "
            f"[{b.offset}, {b.end})); the header is corrupt; re-download the file."
        )
    return out


def overlap(spans: list[tuple[int, int, Any]]) -> tuple[Any, Any] | None:
    """The labels of two non-empty [start, end) spans that overlap, if any do."""
    far = None  # the span reaching furthest so far, in start order
    for span in sorted((s for s in spans if s[1] > s[0]), key=lambda s: s[0]):
        if far is not None and span[0] < far[1]:
            return far[2], span[2]
        if far is None or span[1] > far[1]:
            far = span
    return None


def _naturals(value: object, count: int | None) -> bool:
    """A list of non-negative JSON integers (not bools), of length `count` if given."""
    return isinstance(value, list) and (count is None or len(value) == count) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class SafetensorsIndex:
    """Name → TensorInfo over one file, a directory of shards, or an index.json."""

    def __init__(self, root: Path, tensors: dict[str, TensorInfo]):
        self.root = root
        self.tensors = tensors
        self.checked_against: object = None  # the config check_tensors passed, if any

    @classmethod
    def open(cls, path: str | Path) -> SafetensorsIndex:
        path = Path(path)
        if path.is_file():
            return cls(path.parent, read_header(path))
        if not path.is_dir():
            raise CheckpointError(f"{path} does not exist; point at a checkpoint folder or file.")
        index_file = path / INDEX_FILE
        if index_file.is_file():
            return cls(path, _from_index(path, index_file))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{path} holds no *.safetensors files and no {INDEX_FILE}; "
                "download the checkpoint first."
            )
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in read_header(file).items():
                if name in tensors:
                    raise CheckpointError(
                        f"tensor {name} appears in both {tensors[name].file.name} and "
                        f"{file.name}; remove the stray shard."
                    )
                tensors[name] = info
        return cls(path, tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(
                f"tensor {name} is missing from the checkpoint in {self.root}; the download is "
                "incomplete or this is not a Kimi-K3 checkpoint."
            ) from None

    def read(self, name: str) -> np.ndarray:
        """The tensor in its raw dtype (BF16 as uint16), shaped, freshly read from disk."""
        t = self.info(name)
        with open(t.file, "rb") as f:
            buf = os.pread(f.fileno(), t.nbytes, t.offset)
        if len(buf) != t.nbytes:
            raise CheckpointError(
                f"{t.file}: short read of tensor {name} ({len(buf)} of {t.nbytes} bytes); "
                "the file changed or is truncated."
            )
        return np.frombuffer(buf, dtype=t.np_dtype).reshape(t.shape)

    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})


def _from_index(root: Path, index_file: Path) -> dict[str, TensorInfo]:
    weight_map = load_json(index_file, MAX_INDEX, f"re-download {INDEX_FILE}.").get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file} has no weight_map object; re-download it.")
    headers: dict[str, dict[str, TensorInfo]] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname or Path(fname).name != fname \
                or fname in (".", ".."):
            raise CheckpointError(
                f"{index_file.name} maps tensor {name} to {_short(fname)}, which is not a file "
                "name in the checkpoint folder; re-download the index."
            )
        file = root / fname
        if fname not in headers:
            if not file.is_file():
                raise CheckpointError(
                    f"{index_file.name} maps tensor {name} to {fname}, which does not exist; "
                    "the download is incomplete; resume it."
                )
            headers[fname] = read_header(file)
        info = headers[fname].get(name)
        if info is None:
            raise CheckpointError(
                f"{index_file.name} maps tensor {name} to {fname}, but that file's header has "
                "no such tensor; re-download the file."
            )
        tensors[name] = info
    return tensors
