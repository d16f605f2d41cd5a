"""The MXFP4 codec (OCP Microscaling): E2M1 values, one power-of-two scale byte per group of
32, and the encoder/decoder the reference fixtures were made with. Both kernel
implementations (reference.py, fused.py) decode with these tables."""

from __future__ import annotations

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
