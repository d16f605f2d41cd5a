"""The compact trunk's codec: BF16 matrix <-> c12 (engine/kernels/compact.py) and its
bytes in trunk.bin.

Per tensor the packer chooses: c12 when the matrix is BF16, 2-D, has an even number of
columns and the encoding is at least `MIN_SAVING` smaller; else the raw bytes, as in the
BF16 trunk. A c12 tensor's bytes, each part 64-byte aligned so the kernel reads every
part sequentially per row:
  exponent table u8[16] | sign+mantissa u8[R, C] | codes u8[R, C/2] | row_ptr i64[R+1] |
  exc_col i32[E] | exc_val u16[E]
trunk.json carries E ("exceptions") per tensor; everything read back is checked
(row_ptr monotone from 0 to E, columns in range and increasing within a row, the table's
unused slot zero) before a kernel may index with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import CheckpointError
from engine.kernels.compact import EXCEPTION, TABLE, CompactMatrix
from engine.core.directio import TensorSpec

C12 = "c12"
MIN_SAVING = 0.10  # below this the raw BF16 is kept: not worth a decode
PART = 64


def _up(n: int) -> int:
    return -(-n // PART) * PART


def parts(shape: tuple[int, int], n_exc: int) -> list[tuple[str, int, np.dtype, tuple]]:
    """(part, offset, dtype, shape) of each part of a c12 tensor's bytes."""
    R, C = shape
    out, off = [], 0
    for name, dtype, shp in (("table", np.uint8, (16,)), ("sm", np.uint8, (R, C)),
                             ("codes", np.uint8, (R, C // 2)), ("row_ptr", np.int64, (R + 1,)),
                             ("exc_col", np.int32, (n_exc,)), ("exc_val", np.uint16, (n_exc,))):
        out.append((name, off, np.dtype(dtype), shp))
        off = _up(off + int(np.prod(shp)) * np.dtype(dtype).itemsize)
    return out


def c12_nbytes(shape: tuple[int, int], n_exc: int) -> int:
    """Padded to 64 bytes, so the next tensor of the layer starts aligned and adjacent."""
    name, off, dtype, shp = parts(shape, n_exc)[-1]
    return _up(off + int(np.prod(shp)) * dtype.itemsize)


def eligible(dtype: str, shape: tuple[int, ...]) -> bool:
    return dtype == "BF16" and len(shape) == 2 and shape[1] % 2 == 0 and shape[0] * shape[1] > 0


def encode(bits: np.ndarray) -> CompactMatrix:
    """BF16 bits [R, C] (uint16, C even) → c12, with the 15 most frequent exponents."""
    bits = np.ascontiguousarray(bits, np.uint16)
    exp = ((bits >> 7) & 0xFF).astype(np.uint8)
    counts = np.bincount(exp.ravel(), minlength=256)
    top = np.argsort(-counts, kind="stable")[:TABLE]
    code_of = np.full(256, EXCEPTION, np.uint8)
    code_of[top] = np.arange(TABLE, dtype=np.uint8)
    code = code_of[exp]
    exp_bits = np.zeros(16, np.uint16)
    exp_bits[:TABLE] = top.astype(np.uint16) << 7
    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    codes = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    rows, cols = np.nonzero(code == EXCEPTION)  # row-major: grouped by row
    row_ptr = np.zeros(bits.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=bits.shape[0]), out=row_ptr[1:])
    return CompactMatrix(exp_bits, sm, codes, row_ptr, cols.astype(np.int32), bits[rows, cols])


def to_bytes(m: CompactMatrix) -> bytes:
    n_exc = m.exc_col.size
    out = np.zeros(c12_nbytes(m.shape, n_exc), np.uint8)
    table = (m.exp_bits >> 7).astype(np.uint8)
    table[EXCEPTION] = 0
    arrays = dict(table=table, sm=m.sm, codes=m.codes, row_ptr=m.row_ptr, exc_col=m.exc_col,
                  exc_val=m.exc_val)
    for name, off, dtype, shp in parts(m.shape, n_exc):
        a = np.ascontiguousarray(arrays[name], dtype).reshape(-1).view(np.uint8)
        out[off:off + a.size] = a
    return out.tobytes()


def _sorted_per_row(ptr: np.ndarray, cols: np.ndarray) -> bool:
    """Each row's exception columns strictly increase (the kernel patches them in order)."""
    starts = np.zeros(cols.size, bool)
    starts[ptr[:-1][ptr[:-1] < cols.size]] = True
    return not np.any((np.diff(cols) <= 0) & ~starts[1:])


def from_bytes(raw: np.ndarray, shape: tuple[int, int], n_exc: int, name: str) -> CompactMatrix:
    """Views of a c12 tensor's bytes (raw uint8, as read), checked so no index points out."""
    got = {}
    for part, off, dtype, shp in parts(shape, n_exc):
        n = int(np.prod(shp)) * dtype.itemsize
        got[part] = raw[off:off + n].view(dtype).reshape(shp)
    ptr, cols = got["row_ptr"], got["exc_col"]
    if got["table"][EXCEPTION] != 0 or ptr[0] != 0 or ptr[-1] != n_exc \
            or np.any(np.diff(ptr) < 0) or np.any((cols < 0) | (cols >= shape[1])) \
            or not _sorted_per_row(ptr, cols):
        raise CheckpointError(
            f"the compact trunk's tensor {name} is corrupt (its exception index points "
            "outside the matrix); re-pack the trunk."
        )
    exp_bits = got["table"].astype(np.uint16) << 7
    return CompactMatrix(exp_bits, got["sm"], got["codes"], ptr, cols, got["exc_val"])


@dataclass(frozen=True)
class CompactSpec(TensorSpec):
    """A c12 tensor in trunk.bin: `shape` is the matrix's, `nbytes` its compact size."""

    exceptions: int = 0

    def view_of(self, raw: np.ndarray) -> CompactMatrix:  # type: ignore[override]
        return from_bytes(raw, self.shape, self.exceptions, self.name)


@dataclass(frozen=True)
class Stats:
    weights: int
    nbytes: int
    exceptions: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / max(self.weights, 1)

    @property
    def exception_rate(self) -> float:
        return self.exceptions / max(self.weights, 1)


def measure(bits: np.ndarray) -> Stats:
    """bits/weight and exception rate c12 gives `bits` (uint16 [R, C])."""
    m = encode(bits)
    return Stats(bits.size, c12_nbytes(m.shape, m.exc_col.size), m.exc_col.size)
