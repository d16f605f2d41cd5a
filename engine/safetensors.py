"""A checked index over safetensors files: tensor name → file, absolute offset, dtype, shape.

Format: 8-byte little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets: [start, end]}}` (offsets relative to the end of the header, optional
`__metadata__`), then the raw bytes. Every structural problem (a header that points
outside its file, overlapping tensors, a truncated shard, a tensor the index names but
no file holds) is refused with the file and tensor named, before any math runs.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import CheckpointError

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
MAX_HEADER = 512 * 1024 * 1024  # the real checkpoint's largest header is a few MB


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
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{file}: its header claims {n} bytes but the file holds {size}; the file is "
                    "truncated or not safetensors; re-download it."
                )
            header_bytes = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read {file} ({exc.strerror}); check the path.") from None
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{file}: the header is not valid JSON; re-download it.") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the header is not a JSON object; re-download it.")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = meta["dtype"]
            shape = tuple(int(d) for d in meta["shape"])
            start, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{file}: tensor {name} has a malformed header entry; re-download the file."
            ) from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {dtype}.")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if start < 0 or end - start != want:
            raise CheckpointError(
                f"{file}: tensor {name} spans bytes [{start}, {end}) but dtype {dtype} shape "
                f"{list(shape)} needs {want} bytes; the header is corrupt."
            )
        if base + end > size:
            raise CheckpointError(
                f"{file}: tensor {name} ends at byte {base + end} but the file holds only {size} "
                "bytes (truncated shard or header pointing outside the file); re-download it."
            )
        out[name] = TensorInfo(name, file, base + start, want, dtype, shape)
    ordered = sorted(out.values(), key=lambda t: (t.offset, t.end))
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.offset < prev.end and cur.nbytes and prev.nbytes:
            raise CheckpointError(
                f"{file}: tensors {prev.name} and {cur.name} overlap (bytes "
                f"[{prev.offset}, {prev.end}) and [{cur.offset}, {cur.end})); the header is corrupt."
            )
    return out


class SafetensorsIndex:
    """Name → TensorInfo over one file, a directory of shards, or an index.json."""

    def __init__(self, root: Path, tensors: dict[str, TensorInfo]):
        self.root = root
        self.tensors = tensors

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
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(
            f"{index_file} is unreadable or has no weight_map; re-download it."
        ) from None
    headers: dict[str, dict[str, TensorInfo]] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, fname in weight_map.items():
        file = root / str(fname)
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
