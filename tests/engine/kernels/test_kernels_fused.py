"""The fused MXFP4 kernel: its summation order is spelled out in code, so its bits are
checked exactly against a numpy emulation of that order, across batch sizes, threads,
the serial/parallel builds and the two decoders (table lookup vs IEEE-half bits)."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from engine.kernels import fused, mxfp4, reference


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a·b + c rounded once (a·b is exact in float64; the float64 sum rounds to
    float32 the same way except at ~2^-29-rare double-rounding ties)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def emulate(x: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The kernel's documented order: per 32-group g, lane k (0..15) of the group's bytes:
    part = fma(hi_k, xo_k, lo_k·xe_k) with E2M1·2^-14 values; acc[g % 2] = fma(part, s_g,
    acc[g % 2]); then acc0 + acc1, a halving tree over the 16 lanes, × 2^14."""
    rows, half = packed.shape
    e2m1 = mxfp4.E2M1 * np.float32(2.0**-14)
    lo = e2m1[packed & 0x0F].reshape(rows, -1, 16)
    hi = e2m1[packed >> 4].reshape(rows, -1, 16)
    s = mxfp4.MX_SCALE[scale]  # [rows, groups]
    out = np.empty((x.shape[0], rows), np.float32)
    for t in range(x.shape[0]):
        xe = x[t, 0::2].reshape(-1, 16)
        xo = x[t, 1::2].reshape(-1, 16)
        acc = np.zeros((2, rows, 16), np.float32)
        for g in range(half // 16):
            part = _fma32(hi[:, g], xo[g], (lo[:, g] * xe[g]).astype(np.float32))
            acc[g % 2] = _fma32(part, s[:, g, None], acc[g % 2])
        v = acc[0] + acc[1]
        while v.shape[1] > 1:
            w = v.shape[1] // 2
            v = v[:, :w] + v[:, w:]
        out[t] = v[:, 0] * np.float32(16384.0)
    return out


def random_mxfp4(rng, rows: int, cols: int, lo: int = 115, hi: int = 135):
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scale = rng.integers(lo, hi, (rows, cols // 32), dtype=np.uint8)
    scale[0, 0] = 255  # NaN in OCP MX: decodes to 0
    return packed, scale


@pytest.mark.parametrize("rows,cols,tokens", [(3, 32, 1), (17, 96, 2), (40, 1024, 3), (9, 3584, 1)])
def test_mxfp4_bits_follow_the_documented_order(rows, cols, tokens):
    rng = np.random.default_rng(rows * cols)
    packed, scale = random_mxfp4(rng, rows, cols)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    for parallel in (False, True):
        got = fused.mxfp4_linear(x, packed, scale, parallel)
        assert np.array_equal(got, emulate(x, packed, scale))
    want = reference.mxfp4_linear_ref(x, packed, scale)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_mxfp4_every_code_and_tiny_scales():
    """All 256 bytes in every position, scales down to the smallest (subnormal products)."""
    rng = np.random.default_rng(3)
    packed = np.tile(np.arange(256, dtype=np.uint8), 8).reshape(64, 32)
    scale = np.repeat(np.array([0, 1, 20, 100, 127, 140, 200, 255], np.uint8), 16).reshape(64, 2)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    got = fused.mxfp4_linear(x, packed, scale, False)
    assert np.array_equal(got, emulate(x, packed, scale))
    want = reference.mxfp4_linear_ref(x, packed, scale)
    # any float32 order is off by a few ulps of Σ|w·x| (rows here cancel heavily), and
    # results below float32's normal range keep only a subnormal's absolute precision
    bound = 1e-6 * np.abs(x) @ np.abs(mxfp4.mxfp4_decode(packed, scale)).T
    assert (np.abs(got - want) <= bound + np.finfo(np.float32).tiny).all()


def test_mxfp4_same_bits_for_any_batch_threads_or_build():
    """7 tokens run as blocks of 4, 2 and 1; alone each token must give the same bits."""
    rng = np.random.default_rng(11)
    packed, scale = random_mxfp4(rng, 700, 2048)
    x = rng.standard_normal((7, 2048)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = fused.mxfp4_linear(x, packed, scale, True)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = fused.mxfp4_linear(x, packed, scale, True)
    finally:
        numba.set_num_threads(before)
    serial = fused.mxfp4_linear(x, packed, scale, False)
    assert np.array_equal(one, many) and np.array_equal(one, serial)
    for t in range(7):
        assert np.array_equal(fused.mxfp4_linear(x[t:t + 1], packed, scale, False)[0], one[t])
    assert np.array_equal(fused.mxfp4_linear(x[1:4], packed, scale, False), one[1:4])


def test_table_and_bit_decoders_agree_bit_for_bit():
    """The AVX-512 table lookup (when this CPU has it) and the portable IEEE-half decoder
    give identical results, so the engine's tokens do not depend on the CPU's features."""
    generic1 = fused._make_mxfp4_block(fused._decode_generic, 1, 1)
    generic4 = fused._make_mxfp4_block(fused._decode_generic, 2, 4)

    @numba.njit
    def generic_matmul(packed, scale, xe, xo, out, scales):
        for r in range(0, packed.shape[0], 2):
            generic4(packed, r, min(2, packed.shape[0] - r), xe, xo, 0, 4, scale, scales, out)
            generic1(packed, r, 1, xe, xo, 4, 1, scale, scales, out)
            generic1(packed, r + 1, 1, xe, xo, 4, 1, scale, scales, out)

    rng = np.random.default_rng(4)
    packed, scale = random_mxfp4(rng, 50, 512, 0, 255)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    out = np.empty((5, 50), np.float32)
    generic_matmul(
        packed,
        scale,
        np.ascontiguousarray(x[:, 0::2]),
        np.ascontiguousarray(x[:, 1::2]),
        out,
        mxfp4.MX_SCALE,
    )
    assert np.array_equal(out, fused.mxfp4_linear(x, packed, scale, False), equal_nan=True)


# ---- BF16 ------------------------------------------------------------------------------------
def emulate_bf16(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The BF16 kernel's documented order: 16-column chunk c of each whole 64-column block
    into accumulator c % 4, leftover chunks into accumulator 0, (a0 + a1) + (a2 + a3), a
    halving tree over the 16 lanes, then the last < 16 columns one fma at a time."""
    wf = reference.widen_bf16(w)
    rows, cols = w.shape
    out = np.empty((x.shape[0], rows), np.float32)
    blocks, chunks = cols // 64, (cols % 64) // 16
    for t in range(x.shape[0]):
        acc = np.zeros((4, rows, 16), np.float32)
        for b in range(blocks):
            for c in range(4):
                j = b * 64 + c * 16
                acc[c] = _fma32(wf[:, j : j + 16], x[t, j : j + 16], acc[c])
        for c in range(chunks):
            j = blocks * 64 + c * 16
            acc[0] = _fma32(wf[:, j : j + 16], x[t, j : j + 16], acc[0])
        v = (acc[0] + acc[1]) + (acc[2] + acc[3])
        while v.shape[1] > 1:
            h = v.shape[1] // 2
            v = v[:, :h] + v[:, h:]
        total = v[:, 0]
        for j in range(blocks * 64 + chunks * 16, cols):
            total = _fma32(wf[:, j], x[t, j], total)
        out[t] = total
    return out


def to_bf16(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize(
    "rows,cols,tokens", [(5, 7, 1), (33, 96, 2), (40, 200, 3), (300, 1024, 1), (20, 7168, 2)]
)
def test_bf16_bits_follow_the_documented_order(rows, cols, tokens):
    rng = np.random.default_rng(rows + cols)
    w = to_bf16(rng.standard_normal((rows, cols)))
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    got = fused.linear(x, w)
    assert np.array_equal(got, emulate_bf16(x, w))
    want = reference.linear_ref(x, w)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bf16_same_bits_for_any_batch_threads_or_build():
    rng = np.random.default_rng(12)
    w = to_bf16(rng.standard_normal((1500, 1000)))  # above the parallel threshold
    x = rng.standard_normal((4, 1000)).astype(np.float32)
    out = {}
    before = numba.get_num_threads()
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            out[n] = fused.linear(x, w)
    finally:
        numba.set_num_threads(before)
    serial = np.empty_like(out[1])
    fused._KERNELS[("_bf16_matmul", False)](w, x, serial)
    assert all(np.array_equal(o, serial) for o in out.values())
    for t in range(4):
        assert np.array_equal(fused.linear(x[t : t + 1], w)[0], serial[t])


def test_widen_bf16_is_exact_for_every_bit_pattern():
    raw = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    got = reference.widen_bf16(raw)
    assert got.dtype == np.float32 and got.shape == raw.shape
    assert np.array_equal(got.view(np.uint32), raw.astype(np.uint32) << 16)  # NaN payloads too
    assert reference.widen_bf16(np.array(0x3F80, np.uint16)) == 1.0  # 0-d arrays work
