"""The matrix products the model calls: `linear` (BF16/F32) and `mxfp4_linear`, dispatched to
the fused numba kernels when they load, else to the numpy reference.

Weights arrive in their raw on-disk dtype: BF16 as uint16, F32/F16 as is, MXFP4 as
(packed uint8, scale uint8). Activations are float32 with shape [T, features].

Two implementations of each matrix product:
* the **reference** (pure numpy): widen or decode the weights to float32, then `x @ W.T`;
* a **fused** one (numba, when installed): widen/decode inside the dot product, so each
  weight byte is read from memory once; with several tokens, blocks of rows × tokens share
  each decoded weight vector. Every output element is computed by the same instruction
  sequence whatever T, the thread count or the row split, so a prefill of T tokens gives
  the same bits as T single steps. Tests check fused == reference.
`K3_KERNELS=numpy` forces the reference.
"""

from __future__ import annotations

import os

import numpy as np

from engine.kernels.compact import CompactMatrix
from engine.kernels.reference import linear_ref, mxfp4_linear_ref


def _fused_available() -> bool:
    if os.environ.get("K3_KERNELS", "").lower() == "numpy":
        return False
    try:
        from engine.kernels import fused  # noqa: F401
    except ImportError:
        return False
    return True


FUSED = _fused_available()


def compute_threads() -> int:
    """Threads the fused kernels use (numba's setting), 1 for the numpy reference."""
    if not FUSED:
        return 1
    import numba

    return numba.get_num_threads()


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x Wᵀ for x [T, in] (or [in]) and a raw BF16/F32 weight [out, in]."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    if isinstance(w, CompactMatrix):  # a compact trunk's matrix: the same bits as its BF16
        if FUSED:
            from engine.kernels.fused_compact import c12_linear

            y = c12_linear(x2, w)
        else:
            y = linear_ref(x2, w.bf16())
    elif FUSED and w.dtype in (np.uint16, np.float32) and w.flags.c_contiguous:
        from engine.kernels import fused

        y = fused.linear(x2, w)
    else:
        y = linear_ref(x2, w)
    return y.reshape(*x.shape[:-1], w.shape[0])


def mxfp4_linear(x: np.ndarray, packed: np.ndarray, scale: np.ndarray,
                 parallel: bool | None = None) -> np.ndarray:
    """y = x Wᵀ for an MXFP4 weight, x [T, in]; `parallel` as in fused.mxfp4_linear."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    if FUSED and packed.flags.c_contiguous and scale.flags.c_contiguous:
        from engine.kernels import fused

        y = fused.mxfp4_linear(x2, packed, scale, parallel)
    else:
        y = mxfp4_linear_ref(x2, packed, scale)
    return y.reshape(*x.shape[:-1], packed.shape[0])
