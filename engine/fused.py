"""Fused matrix kernels compiled by numba: widen/decode inside the dot product.

A BF16 weight row is widened once into a small per-thread buffer that stays in L1, then
dotted with every token's activations; an MXFP4 row is decoded inside the dot product
(see `_mxfp4_matmul`). Rows are split across threads; each output element is produced
by the same instruction sequence whatever the number of tokens or threads, so results
do not depend on either.
Importing this module raises ImportError when numba is missing; kernels.py then uses
the numpy reference.
"""

from __future__ import annotations

import os
import types as pytypes

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.core.extending import intrinsic

from engine.kernels import MX_GROUP, MX_SCALE

# OpenMP workers spin while idle by default: on a shared 2-core machine that burns the CPU
# the other thread (or another process) needs. Must be set before the first parallel run.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

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


@intrinsic
def _half_to_f32(typingctx, bits):
    """IEEE half bits (an integer) → float32, exactly (F16C vcvtph2ps on x86)."""
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width > 16:
            v = builder.trunc(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return sig, codegen


_U = np.uint16


def _mxfp4_matmul(packed, scale, xe, xo, out, scales):
    """E2M1 code n, placed as IEEE-half bits (magnitude n&7 at bit 9, sign n&8 at bit 15),
    is exactly E2M1[n]·2^-14 — E2M1's subnormals land on half subnormals, which the
    conversion handles exactly — so decoding is a few integer ops and one conversion, no
    table lookup. x arrives split into even (low nibble) and odd (high nibble) columns;
    each 32-group's dot product is scaled once; 2^14 is restored at the end."""
    rows, half = packed.shape
    tokens = xe.shape[0]
    n_groups = half // 16
    for r in prange(rows):
        for t in range(tokens):
            acc = np.float32(0.0)
            for g in range(n_groups):
                base = g * 16
                part = np.float32(0.0)
                for k in range(16):
                    b = _U(packed[r, base + k])
                    lo = _U(_U(_U(b & _U(0x07)) << _U(9)) | _U(_U(b & _U(0x08)) << _U(12)))
                    hi = _U(_U(_U(b & _U(0x70)) << _U(5)) | _U(_U(b & _U(0x80)) << _U(8)))
                    part += _half_to_f32(lo) * xe[t, base + k] + _half_to_f32(hi) * xo[t, base + k]
                acc += part * scales[scale[r, g]]
            out[t, r] = acc * np.float32(16384.0)


def _build(fn, parallel: bool):
    """Compile `fn` serial or parallel (`prange` is a plain range in the serial build, so
    both compute every output element with the same instruction sequence). Each build
    gets its own function name: numba's on-disk cache is keyed by the function, and
    sharing one would hand the parallel caller the serial machine code."""
    name = f"{fn.__name__}_{'parallel' if parallel else 'serial'}"
    clone = pytypes.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = name
    return njit(parallel=parallel, **_FLAGS)(clone)


_KERNELS = {
    (fn.__name__, parallel): _build(fn, parallel)
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


def mxfp4_linear(x: np.ndarray, packed: np.ndarray, scale: np.ndarray,
                 parallel: bool | None = None) -> np.ndarray:
    """`parallel=None` decides by size; the MoE passes False and spreads experts over
    threads itself."""
    if packed.shape[1] * 2 % MX_GROUP or scale.shape[1] * MX_GROUP != packed.shape[1] * 2:
        raise ValueError(f"MXFP4 shapes disagree: packed {packed.shape}, scale {scale.shape}")
    out = np.empty((x.shape[0], packed.shape[0]), np.float32)
    par = packed.size * 2 >= PARALLEL_MIN_WEIGHTS if parallel is None else parallel
    xe, xo = np.ascontiguousarray(x[:, 0::2]), np.ascontiguousarray(x[:, 1::2])
    _KERNELS[("_mxfp4_matmul", par)](packed, scale, xe, xo, out, MX_SCALE)
    return out


def warm_up() -> None:
    """Load (or compile) every kernel now, so the first token does not pay for it."""
    x = np.zeros((1, 64), np.float32)
    out = np.empty((1, 2), np.float32)
    for parallel in (False, True):
        _KERNELS[("_bf16_matmul", parallel)](np.zeros((2, 64), np.uint16), x, out)
        _KERNELS[("_f32_matmul", parallel)](np.zeros((2, 64), np.float32), x, out)
        _KERNELS[("_mxfp4_matmul", parallel)](np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.uint8),
                                              x[:, :16], x[:, :16], out, MX_SCALE)


def set_threads(n: int) -> None:
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
