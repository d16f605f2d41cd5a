"""Elementwise and matrix kernels, in the spec's notation (section 1.4).

Weights arrive in their raw on-disk dtype: BF16 as uint16, F32/F16 as is, MXFP4 as
(packed uint8, scale uint8). Activations are float32 with shape [T, features].

Two implementations of each matrix product:
* the **reference** (pure numpy): widen or decode the weights to float32, then `x @ W.T`;
* a **fused** one (numba, when installed): widen/decode inside the dot product, one weight
  row at a time, so each weight byte is touched once. Every output element is computed
  by the same code whatever T, the thread count or the row split, so a prefill of T
  tokens gives the same bits as T single steps. Tests check fused == reference.
`K3_KERNELS=numpy` forces the reference.
"""

from __future__ import annotations

import os

import numpy as np

E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
# 2^(s−127) for each scale byte; 255 (NaN in OCP MX) decodes to 0 so one corrupt byte
# kills a 32-group, not a row.
MX_SCALE = np.where(np.arange(256) == 255, 0.0, np.ldexp(1.0, np.arange(256) - 127)).astype(
    np.float32
)
MX_GROUP = 32


# ---- conversions -------------------------------------------------------------------------
def widen_bf16(raw: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) → float32, exactly: shift into the high half (one pass, the
    uint16 → uint32 cast happens inside the shift: ~5x faster than cast, then shift)."""
    out = np.empty(raw.shape, np.uint32)
    np.left_shift(raw, np.uint32(16), out=out)
    return out.view(np.float32)


def to_f32(a: np.ndarray) -> np.ndarray:
    """Any raw trunk tensor → float32 (BF16 widened, F16/F32 converted)."""
    if a.dtype == np.uint16:
        return widen_bf16(a)
    if a.dtype == np.float32:
        return a
    return a.astype(np.float32)


def mxfp4_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MXFP4 [rows, in/2] + scales [rows, in/32] → float32 [rows, in]; low nibble = even."""
    rows, half = packed.shape
    out = np.empty((rows, half * 2), np.float32)
    out[:, 0::2] = E2M1[packed & 0x0F]
    out[:, 1::2] = E2M1[packed >> 4]
    return out * np.repeat(MX_SCALE[scale], MX_GROUP, axis=1)


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, in] → (packed, scale): exponent floor(log2 max|w|) − 2 per group,
    nearest E2M1 value (no negative-zero codes), the encoder the tiny-a fixture was made
    with; decode(encode(w)) is the nearest representable matrix and encodes to itself."""
    rows, cols = w.shape
    if cols % MX_GROUP:
        raise ValueError(f"MXFP4 needs a width divisible by {MX_GROUP}, got {cols}")
    g = w.reshape(rows, cols // MX_GROUP, MX_GROUP).astype(np.float32)
    amax = np.abs(g).max(axis=2)
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2, -127)
    sbyte = np.clip(exp + 127, 0, 254).astype(np.uint8)
    q = g / MX_SCALE[sbyte][:, :, None]
    mids = (E2M1[:7] + E2M1[1:8]) / 2  # nearest magnitude; a tie goes to the smaller one
    a = np.abs(q)
    code = np.zeros(a.shape, np.uint8)
    for m in mids:
        code += a > m
    code = np.where((q < 0) & (code > 0), code | 8, code).reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, sbyte


# ---- elementwise ---------------------------------------------------------------------------
def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(−x) → inf for very negative x gives the right 0
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x * sigmoid(x)).astype(np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """w ⊙ x / sqrt(mean(x²) + eps) over the last axis; mean of squares in double."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return ((x / np.sqrt(ms + eps)).astype(np.float32) * to_f32(w)).astype(np.float32)


def situ_glu(g: np.ndarray, u: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    """[β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)] — the sigmoid sees the uncapped g."""
    gate = np.float32(beta) * np.tanh(g / np.float32(beta)) * sigmoid(g)
    up = np.float32(linear_beta) * np.tanh(u / np.float32(linear_beta))
    return (gate * up).astype(np.float32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


# ---- matrix products -------------------------------------------------------------------------
def linear_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x Wᵀ with the weights widened first (the reference)."""
    return np.asarray(x, np.float32) @ to_f32(w).T


def mxfp4_linear_ref(x: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32) @ mxfp4_decode(packed, scale).T


def _fused_available() -> bool:
    if os.environ.get("K3_KERNELS", "").lower() == "numpy":
        return False
    try:
        from engine import fused  # noqa: F401
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
    if FUSED and w.dtype in (np.uint16, np.float32) and w.flags.c_contiguous:
        from engine import fused

        y = fused.linear(x2, w)
    else:
        y = linear_ref(x2, w)
    return y.reshape(*x.shape[:-1], w.shape[0])


def mxfp4_linear(x: np.ndarray, packed: np.ndarray, scale: np.ndarray,
                 parallel: bool | None = None) -> np.ndarray:
    """y = x Wᵀ for an MXFP4 weight, x [T, in]; `parallel` as in fused.mxfp4_linear."""
    x2 = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    if FUSED and packed.flags.c_contiguous and scale.flags.c_contiguous:
        from engine import fused

        y = fused.mxfp4_linear(x2, packed, scale, parallel)
    else:
        y = mxfp4_linear_ref(x2, packed, scale)
    return y.reshape(*x.shape[:-1], packed.shape[0])
