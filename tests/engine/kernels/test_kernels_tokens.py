"""The multi-token kernels (a prefill's, a chunk's, the head's for several positions): every
output bit-identical to the one-token kernel's for T = 1..40, at shapes that leave partial
row and token blocks, leftover 16-column chunks, a last column panel and < 16 tail columns,
at every thread count and in the serial and parallel builds."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from engine import kernels
from engine.checkpoint.compact import encode
from engine.kernels import fused, fused_compact
from test_kernels_fused import emulate, emulate_bf16, random_mxfp4, to_bf16

TOKENS = range(1, 41)


def thread_counts() -> list[int]:
    return list(range(1, numba.config.NUMBA_NUM_THREADS + 1))


def one_by_one(product, x: np.ndarray) -> np.ndarray:
    """Each token through the one-token kernel on its own."""
    return np.concatenate([product(x[t : t + 1]) for t in range(len(x))])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def bf16_tokens(w: np.ndarray, x: np.ndarray, parallel: bool) -> np.ndarray:
    out = np.empty((len(x), w.shape[0]), np.float32)
    fused._KERNELS[("_bf16_matmul_tokens", parallel)](w, x, out)
    return out


def bf16_one(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    out = np.empty((1, w.shape[0]), np.float32)
    fused._KERNELS[("_bf16_matmul", False)](w, x, out)
    return out


# 1141 columns = 17 blocks of 64 (a 1024-column panel and one more), 3 leftover chunks of
# 16 and 5 single columns; 37 rows = 2 tasks of 16 and a partial one, a partial row block
@pytest.mark.parametrize("rows,cols", [(37, 1141), (6, 40), (21, 64), (5, 7), (1000, 1141)])
def test_bf16_tokens_equal_one_token_each(rows, cols):
    rng = np.random.default_rng(rows * cols)
    w = to_bf16(rng.standard_normal((rows, cols)))
    x = rng.standard_normal((max(TOKENS), cols)).astype(np.float32)
    single = one_by_one(lambda xt: bf16_one(w, xt), x)
    for T in TOKENS:
        for parallel in (False, True):
            assert same_bits(bf16_tokens(w, x[:T], parallel), single[:T]), (T, parallel)
    assert same_bits(fused.linear(x[:9], w), emulate_bf16(x[:9], w))  # the documented order


def test_bf16_tokens_same_bits_at_every_thread_count():
    rng = np.random.default_rng(7)
    w = to_bf16(rng.standard_normal((1030, 1100)))  # above the parallel threshold
    x = rng.standard_normal((23, 1100)).astype(np.float32)
    want = one_by_one(lambda xt: bf16_one(w, xt), x)
    before = numba.get_num_threads()
    try:
        for n in thread_counts():
            numba.set_num_threads(n)
            assert same_bits(bf16_tokens(w, x, True), want), n
            assert same_bits(kernels.linear(x, w), want), n
    finally:
        numba.set_num_threads(before)


def test_c12_tokens_equal_one_token_each():
    """Exception-heavy rows (wide exponents) so the decode patches many chunks; c12 needs
    an even width: 1142 leaves 6 single columns."""
    rng = np.random.default_rng(3)
    bits = to_bf16(rng.standard_normal((37, 1142)) * np.exp(3 * rng.standard_normal((37, 1142))))
    m = encode(bits)
    assert m.exc_col.size > 1000
    x = rng.standard_normal((max(TOKENS), 1142)).astype(np.float32)
    single = one_by_one(lambda xt: fused_compact.c12_linear(xt, m), x)
    assert same_bits(single, one_by_one(lambda xt: bf16_one(bits, xt), x))
    parts = fused_compact._parts(m)
    before = numba.get_num_threads()
    try:
        for T in TOKENS:
            for parallel in (False, True):
                out = np.empty((T, 37), np.float32)
                fused_compact._KERNELS[("_c12_matmul_tokens", parallel)](*parts, x[:T], out)
                assert same_bits(out, single[:T]), (T, parallel)
        for n in thread_counts():
            numba.set_num_threads(n)
            assert same_bits(kernels.linear(x[:17], m), single[:17]), n
    finally:
        numba.set_num_threads(before)


def test_c12_row_decode_gives_the_bf16_bits_with_every_lookup():
    """The multi-token c12 kernel decodes rows first: with each exponent lookup this CPU can
    run, the decoded rows are the matrix's BF16 bits exactly."""
    fc = fused_compact
    rng = np.random.default_rng(5)
    bits = to_bf16(rng.standard_normal((9, 98)) * np.exp(4 * rng.standard_normal((9, 98))))
    m = encode(bits)
    tried = 0
    for lookup, feature in ((fc._lookup_vpermd, "avx512f"), (fc._lookup_pshufb, "ssse3"),
                            (fc._lookup_select, None)):
        if feature and not fc._host_has(feature):
            continue
        decode = fc._make_c12_row_decode(lookup)

        @numba.njit
        def decode_all(e, s, c, p, ec, ev, out):
            for r in range(s.shape[0]):
                decode(e, s, c, p, ec, ev, r, out, r)

        out = np.zeros(bits.shape, np.uint16)
        decode_all(*fc._parts(m), out)
        assert np.array_equal(out, bits)
        tried += 1
    assert tried >= 1


def mxfp4_tokens(packed, scale, x, parallel: bool) -> np.ndarray:
    return fused.mxfp4_linear(x, packed, scale, parallel)


# 67 rows: a task of 64 and one of 3 (a partial row block); 224 columns: 7 groups of 32,
# an odd group after the pairs
@pytest.mark.parametrize("rows,cols", [(67, 224), (3, 32), (130, 1024)])
def test_mxfp4_tokens_equal_one_token_each(rows, cols):
    rng = np.random.default_rng(rows + cols)
    packed, scale = random_mxfp4(rng, rows, cols)
    x = rng.standard_normal((max(TOKENS), cols)).astype(np.float32)
    single = one_by_one(lambda xt: mxfp4_tokens(packed, scale, xt, False), x)
    for T in TOKENS:
        for parallel in (False, True):
            assert same_bits(mxfp4_tokens(packed, scale, x[:T], parallel), single[:T]), T
    assert same_bits(single[:5], emulate(x[:5], packed, scale))  # the documented order
    before = numba.get_num_threads()
    try:
        for n in thread_counts():
            numba.set_num_threads(n)
            assert same_bits(mxfp4_tokens(packed, scale, x[:13], True), single[:13]), n
    finally:
        numba.set_num_threads(before)
