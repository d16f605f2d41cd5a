"""Fused matrix kernels compiled by numba: widen/decode inside the dot product.

Each weight row is widened (BF16) or decoded (MXFP4) once into a small per-thread buffer
that stays in L1, then dotted with every token's activations. Rows are split across
threads; each output element is produced by the same instruction sequence whatever the
number of tokens or threads, so results do not depend on either.
Importing this module raises ImportError when numba is missing; kernels.py then uses
the numpy reference.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from engine.kernels import E2M1, MX_GROUP, MX_SCALE

ROWS_PER_TASK = 16
# Waking the thread pool costs ~0.1-5 ms on a busy 2-core machine: small products run serial.
PARALLEL_MIN_WEIGHTS = 1 << 20
_FLAGS = dict(fastmath=True, cache=True, nogil=True, error_model="numpy")


def _bf16_matmul(w, x, out):  # w uint16 [R, C], x f32 [T, C], out f32 [T, R]
    rows, cols = w.shape
    tokens = x.shape[0]
    n_tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        buf = np.empty(cols, np.float32)
        bits = buf.view(np.uint32)
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            for j in range(cols):
                bits[j] = np.uint32(w[r, j]) << np.uint32(16)
            for t in range(tokens):
                acc = np.float32(0.0)
                for j in range(cols):
                    acc += buf[j] * x[t, j]
                out[t, r] = acc


def _f32_matmul(w, x, out):  # w f32 [R, C]
    rows, cols = w.shape
    tokens = x.shape[0]
    for r in prange(rows):
        for t in range(tokens):
            acc = np.float32(0.0)
            for j in range(cols):
                acc += w[r, j] * x[t, j]
            out[t, r] = acc


def _mxfp4_matmul(packed, scale, x, out, lut, scales):
    rows, half = packed.shape
    cols = half * 2
    tokens = x.shape[0]
    n_groups = cols // 32
    n_tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        buf = np.empty(cols, np.float32)
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            for g in range(n_groups):
                s = scales[scale[r, g]]
                for k in range(16):
                    b = packed[r, g * 16 + k]
                    buf[g * 32 + 2 * k] = lut[b & 15] * s
                    buf[g * 32 + 2 * k + 1] = lut[b >> 4] * s
            for t in range(tokens):
                acc = np.float32(0.0)
                for j in range(cols):
                    acc += buf[j] * x[t, j]
                out[t, r] = acc


# The same source compiled twice: `prange` is a plain range in the serial build, so both
# builds compute every output element with the same instruction sequence.
_KERNELS = {
    (fn.__name__, parallel): njit(parallel=parallel, **_FLAGS)(fn)
    for fn in (_bf16_matmul, _f32_matmul, _mxfp4_matmul)
    for parallel in (False, True)
}


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    par = w.size >= PARALLEL_MIN_WEIGHTS  # by matrix only: a step and a prefill agree
    if w.dtype == np.uint16:
        _KERNELS[("_bf16_matmul", par)](w, x, out)
    else:
        _KERNELS[("_f32_matmul", par)](w, x, out)
    return out


def mxfp4_linear(x: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    if packed.shape[1] * 2 % MX_GROUP or scale.shape[1] * MX_GROUP != packed.shape[1] * 2:
        raise ValueError(f"MXFP4 shapes disagree: packed {packed.shape}, scale {scale.shape}")
    out = np.empty((x.shape[0], packed.shape[0]), np.float32)
    par = packed.size * 2 >= PARALLEL_MIN_WEIGHTS
    _KERNELS[("_mxfp4_matmul", par)](packed, scale, x, out, E2M1, MX_SCALE)
    return out


def set_threads(n: int) -> None:
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
