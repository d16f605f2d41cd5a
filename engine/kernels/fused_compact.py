"""The fused c12 matmul (numba): each weight row is decoded from its compact form into a
one-row scratch (L1-sized, never a full-size BF16 copy) and multiplied by the very same
`_bf16_row_dot` the BF16 kernel uses, so every output element is summed in the same
order and is bit-identical to the BF16 product of the decoded weights. The weight bytes
are read once, 12 bits each (plus exceptions), sequentially per row.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from engine.kernels.compact import CompactMatrix
from engine.kernels.fused import PARALLEL_MIN_WEIGHTS, ROWS_PER_TASK, _bf16_row_dot, _build


def _c12_matmul(exp_bits, sm, codes, row_ptr, exc_col, exc_val, x, out):
    rows, cols = sm.shape
    tokens = x.shape[0]
    n_tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        row = np.empty((1, cols), np.uint16)
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            for k in range(cols // 2):
                c = codes[r, k]
                a, b = np.uint16(sm[r, 2 * k]), np.uint16(sm[r, 2 * k + 1])
                row[0, 2 * k] = ((a & 0x80) << 8) | exp_bits[c & 0x0F] | (a & 0x7F)
                row[0, 2 * k + 1] = ((b & 0x80) << 8) | exp_bits[c >> 4] | (b & 0x7F)
            for e in range(row_ptr[r], row_ptr[r + 1]):
                row[0, exc_col[e]] = exc_val[e]
            for t in range(tokens):
                out[t, r] = _bf16_row_dot(row, 0, x, t)


_KERNELS = {par: _build(_c12_matmul, par, exact=True) for par in (False, True)}


def c12_linear(x: np.ndarray, w: CompactMatrix) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    par = w.size >= PARALLEL_MIN_WEIGHTS  # the BF16 kernel's rule, so both split alike
    _KERNELS[par](w.exp_bits, w.sm, w.codes, w.row_ptr, w.exc_col, w.exc_val, x, out)
    return out


def warm_up() -> None:
    args = (np.zeros(16, np.uint16), np.zeros((2, 64), np.uint8), np.zeros((2, 32), np.uint8),
            np.zeros(3, np.int64), np.zeros(0, np.int32), np.zeros(0, np.uint16),
            np.zeros((1, 64), np.float32), np.empty((1, 2), np.float32))
    for par in (False, True):
        _KERNELS[par](*args)
