"""The compact lossless BF16 form ("c12") and its decode; the encoder is in
engine/checkpoint/compact.py.

A BF16 weight is sign (1 bit), exponent (8) and mantissa (7). Trained and initialised
weights use a handful of exponents, so each weight is stored as one byte (sign << 7 |
mantissa) plus a 4-bit code into a per-matrix table of 15 exponents: 12 bits instead of
16. Code 15 marks an exception: its exact BF16 bits are kept apart, per row (CSR: row r's
exceptions are entries row_ptr[r]..row_ptr[r+1] of exc_col/exc_val). Decoding gives the
original bits exactly, so any product computed from them is bit-identical to the BF16 one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EXCEPTION = 15  # the code of a weight whose exponent is not in the table
TABLE = 15  # exponents in the table


@dataclass(frozen=True)
class CompactMatrix:
    """A BF16 matrix [rows, cols] in c12 form. `exp_bits[c]` is table exponent c already
    shifted into BF16 position (<< 7); exp_bits[15] = 0 (exceptions are patched in)."""

    exp_bits: np.ndarray  # uint16 [16]
    sm: np.ndarray  # uint8 [rows, cols]: sign << 7 | mantissa
    codes: np.ndarray  # uint8 [rows, cols // 2]: column 2k in the low nibble, 2k+1 high
    row_ptr: np.ndarray  # int64 [rows + 1]
    exc_col: np.ndarray  # int32 [n_exceptions]
    exc_val: np.ndarray  # uint16 [n_exceptions]: the exceptions' BF16 bits

    ndim = 2
    dtype = np.dtype(np.uint16)  # what it stands for: raw BF16 bits

    @property
    def shape(self) -> tuple[int, int]:
        return self.sm.shape

    @property
    def size(self) -> int:
        return self.sm.size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.exp_bits, self.sm, self.codes, self.row_ptr,
                                      self.exc_col, self.exc_val))

    def bf16(self, rows: slice = slice(None)) -> np.ndarray:
        """The original BF16 bits (uint16) of `rows`, exactly (the numpy reference decode)."""
        sm = self.sm[rows].astype(np.uint16)
        codes = self.codes[rows]
        nib = np.empty(sm.shape, np.uint8)
        nib[:, 0::2], nib[:, 1::2] = codes & 0x0F, codes >> 4
        out = ((sm & 0x80) << 8) | self.exp_bits[nib] | (sm & 0x7F)
        r0, r1, _ = rows.indices(self.shape[0])
        lo, hi = int(self.row_ptr[r0]), int(self.row_ptr[r1])
        where = np.repeat(np.arange(r1 - r0), np.diff(self.row_ptr[r0:r1 + 1]))
        out[where, self.exc_col[lo:hi]] = self.exc_val[lo:hi]
        return out
