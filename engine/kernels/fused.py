"""Fused matrix kernels compiled by numba: widen/decode inside the dot product.

The BF16 and MXFP4 row dot products are written as 16-lane LLVM vector IR (numba
intrinsics): the weight row is widened/decoded in registers and multiplied at once, so
each weight byte is read from memory once, and the summation order is spelled out in the
code rather than left to fast-math reassociation. Rows are split across threads; each
output element is produced by the same instruction sequence whatever the number of tokens
or threads, so results depend on neither (tests/engine/kernels/test_kernels_fused.py checks the
bits against a numpy emulation of each documented order).
BF16 (and c12) products of one to three tokens stream each row once, a row dot per token;
from four tokens on (a prefill, the head at several positions), and MXFP4 from two, they
go through register blocks of rows × tokens: a decoded 16-lane weight vector feeds every
token's accumulator and an x vector every row's, so T tokens cost far less than T passes.
Each output still gets the one-token instruction sequence; only the order in which
independent outputs and accumulators are worked on differs
(tests/engine/kernels/test_kernels_tokens.py checks them bit for bit against one token).
Importing this module raises ImportError when numba is missing; kernels/__init__.py then uses
the numpy reference.
"""

from __future__ import annotations

import os
import types as pytypes

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.core.extending import intrinsic

from engine.kernels.mxfp4 import E2M1, MX_GROUP, MX_SCALE

# OpenMP workers spin while idle by default: on a shared 2-core machine that burns the CPU
# the other thread (or another process) needs. Must be set before the first parallel run.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

ROWS_PER_TASK = 16
# Waking the thread pool costs ~0.1-5 ms on a busy 2-core machine: small products run serial.
PARALLEL_MIN_WEIGHTS = 1 << 20
_FLAGS = {"fastmath": True, "cache": True, "nogil": True, "error_model": "numpy"}


def _f32_matmul(w, x, out):  # w f32 [R, C]
    rows, cols = w.shape
    tokens = x.shape[0]
    for r in prange(rows):
        for t in range(tokens):
            acc = np.float32(0.0)
            for j in range(cols):
                acc += w[r, j] * x[t, j]
            out[t, r] = acc


# ---- MXFP4 row dot product, written as LLVM vector IR ------------------------------------------
# Auto-vectorised scalar code decoded with many integer ops per nibble and summed each
# 32-group horizontally; spelling the loop out as 16-lane vectors keeps the partial sums in
# registers and fixes the summation order in the code (no fast-math reassociation), so it
# is the same on every machine, thread count and batch size.
_LANES = 16
# Software prefetch this far ahead of the bytes being decoded (about two expert rows):
# without it a core waits on memory between bursts of decoding, +40% from RAM measured.
PREFETCH_BYTES = 4096
_F32 = ir.FloatType()
_VF = ir.VectorType(_F32, _LANES)
_VI8 = ir.VectorType(ir.IntType(8), _LANES)
_VI16 = ir.VectorType(ir.IntType(16), _LANES)
_VI32 = ir.VectorType(ir.IntType(32), _LANES)
# E2M1 times 2^-14 (exact): what the generic decode below produces via IEEE-half bits.
_E2M1_2M14 = ir.Constant(_VF, [float(v) * 2.0**-14 for v in E2M1])


def _host_has_avx512() -> bool:
    """vpermps on 16 floats is one instruction that looks up all 16 E2M1 codes; only when
    numba compiles for this very CPU (NUMBA_CPU_NAME unset)."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get("avx512f"))
    except RuntimeError:  # features unknown on this platform: the generic decode is always right
        return False


def _splat(ty: ir.VectorType, v) -> ir.Constant:
    return ir.Constant(ty, [v] * _LANES)


def _vfma(builder, a, b, c):
    """a·b + c rounded once: a defined result on every machine (FMA hardware or not)."""
    fnty = ir.FunctionType(_VF, [_VF, _VF, _VF])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v16f32"),
                        [a, b, c])


def _decode_generic(builder, b):
    """16 packed bytes → (low-nibble, high-nibble) float vectors of E2M1·2^-14. Code n
    placed as IEEE-half bits (magnitude n&7 at bit 9, sign n&8 at bit 15) is exactly
    E2M1[n]·2^-14: E2M1's subnormals land on half subnormals, which convert exactly. The
    high byte of that half is built per byte, widened and converted."""
    lo = builder.or_(builder.shl(builder.and_(b, _splat(_VI8, 0x08)), _splat(_VI8, 4)),
                     builder.shl(builder.and_(b, _splat(_VI8, 0x07)), _splat(_VI8, 1)))
    hi = builder.or_(builder.and_(b, _splat(_VI8, 0x80)),
                     builder.and_(builder.lshr(b, _splat(_VI8, 3)), _splat(_VI8, 0x0E)))

    def to_f32(hb):
        h = builder.shl(builder.zext(hb, _VI16), _splat(_VI16, 8))
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), _LANES)), _VF)

    return to_f32(lo), to_f32(hi)


def _decode_avx512(builder, b):
    """The same values by table lookup: vpermps reads only an index's low 4 bits."""
    fnty = ir.FunctionType(_VF, [_VF, _VI32])
    perm = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.permvar.sf.512")
    idx = builder.zext(b, _VI32)
    return (builder.call(perm, [_E2M1_2M14, idx]),
            builder.call(perm, [_E2M1_2M14, builder.lshr(idx, _splat(_VI32, 4))]))


_PREFETCH_READ_L1 = [ir.Constant(ir.IntType(32), v) for v in (0, 3, 1)]  # read, keep, data


def _prefetch_fn(builder):
    """llvm.prefetch: a hint, never a fault, so it may point past the matrix's end."""
    fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()] + [ir.IntType(32)] * 3)
    return cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")


def _lane_sum(builder, v):
    """Fixed halving tree over a vector's lanes: lane i += lane i + width/2."""
    width = v.type.count
    while width > 1:
        width //= 2
        lanes = [ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(k, k + width)))
                 for k in (0, width)]
        lo, hi = builder.shuffle_vector(v, v, lanes[0]), builder.shuffle_vector(v, v, lanes[1])
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


def _clamped(builder, n: int, limit):
    """0..n−1 as IR indices, those at or past `limit` replaced by limit − 1: a block that
    overhangs the matrix repeats its last row or token (the same value to the same place)."""
    ity = limit.type
    top = builder.sub(limit, ir.Constant(ity, 1))
    return [builder.select(builder.icmp_signed("<", ir.Constant(ity, k), limit),
                           ir.Constant(ity, k), top) for k in range(n)]


def _make_mxfp4_block(decode, n_rows: int, n_tokens: int):
    @intrinsic
    def mxfp4_block(typingctx, packed, r0, valid, xe, xo, t0, tvalid, scale, scales, out):
        """out[t, r] = Σ_i W[r, i]·x[t, i] for the MXFP4 rows r0.. (`n_rows`, those past
        `valid` repeating the last) and tokens t0.. (`n_tokens`, past `tvalid` likewise),
        x split into even/odd columns. Each 32-group of a row is decoded once for all the
        tokens, and each token's x vectors serve all the rows. Per output, lane k of two
        16-lane accumulators (even / odd 32-groups) sums, group after group,
        fma(fma(hi_k, xo_k, lo_k·xe_k), scale, acc) with E2M1·2^-14 values; then
        acc_even + acc_odd, a fixed halving tree over the lanes, × 2^14. An output's bits
        do not depend on the block it was computed in."""
        sig = types.none(packed, r0, valid, xe, xo, t0, tvalid, scale, scales, out)

        def codegen(context, builder, signature, args):
            pk, r0, valid, xe, xo, t0, tvalid, sc, tab, res = args
            pkty, _, _, xety, xoty, _, _, scty, tabty, resty = signature.args
            ity = r0.type
            zero, one, two = (ir.Constant(ity, v) for v in (0, 1, 2))

            def ptr(ty, val, i, j):
                arr = context.make_array(ty)(context, builder, val)
                return cgutils.get_item_pointer(context, builder, ty, arr, [i, j])

            half = cgutils.unpack_tuple(
                builder, context.make_array(pkty)(context, builder, pk).shape, 2
            )[1]
            n_groups = builder.udiv(half, ir.Constant(ity, 16))
            rows = [builder.add(r0, i) for i in _clamped(builder, n_rows, valid)]
            toks = [builder.add(t0, t) for t in _clamped(builder, n_tokens, tvalid)]
            prows = [ptr(pkty, pk, r, zero) for r in rows]
            srows = [ptr(scty, sc, r, zero) for r in rows]
            erows = [ptr(xety, xe, t, zero) for t in toks]
            orows = [ptr(xoty, xo, t, zero) for t in toks]
            table = context.make_array(tabty)(context, builder, tab).data
            accs = {
                (i, t): [cgutils.alloca_once_value(builder, ir.Constant(_VF, None))
                         for _ in range(2)]
                for i in range(n_rows) for t in range(n_tokens)
            }

            def group(g, chain):
                off = builder.mul(g, ir.Constant(g.type, 16))
                ws = []
                for prow, srow in zip(prows, srows):
                    b = builder.load(
                        builder.bitcast(builder.gep(prow, [off]), _VI8.as_pointer()), align=1
                    )
                    lo, hi = decode(builder, b)
                    s = builder.load(builder.gep(
                        table, [builder.zext(builder.load(builder.gep(srow, [g])), g.type)]))
                    sv = builder.insert_element(
                        ir.Constant(_VF, ir.Undefined), s, ir.Constant(ir.IntType(32), 0)
                    )
                    ws.append((lo, hi, builder.shuffle_vector(sv, sv,
                                                              ir.Constant(_VI32, [0] * _LANES))))
                for t, (erow, orow) in enumerate(zip(erows, orows)):
                    xev = builder.load(
                        builder.bitcast(builder.gep(erow, [off]), _VF.as_pointer()), align=4
                    )
                    xov = builder.load(
                        builder.bitcast(builder.gep(orow, [off]), _VF.as_pointer()), align=4
                    )
                    for i, (lo, hi, sv) in enumerate(ws):
                        acc = accs[i, t][chain]
                        part = _vfma(builder, hi, xov, builder.fmul(lo, xev))
                        builder.store(_vfma(builder, part, sv, builder.load(acc)), acc)

            prefetch = _prefetch_fn(builder)
            with cgutils.for_range(builder, builder.udiv(n_groups, two)) as loop:  # two chains
                g0 = builder.mul(loop.index, two)
                ahead = builder.add(
                    builder.mul(g0, ir.Constant(ity, 16)), ir.Constant(ity, PREFETCH_BYTES)
                )
                for prow in prows:
                    builder.call(prefetch, [builder.gep(prow, [ahead]), *_PREFETCH_READ_L1])
                group(g0, 0)
                group(builder.add(g0, one), 1)
            with builder.if_then(builder.icmp_unsigned("!=", builder.urem(n_groups, two), zero)):
                group(builder.sub(n_groups, one), 0)
            for (i, t), acc in accs.items():
                total = _lane_sum(builder, builder.fadd(builder.load(acc[0]), builder.load(acc[1])))
                builder.store(builder.fmul(total, ir.Constant(_F32, 16384.0)),
                              ptr(resty, res, toks[t], rows[i]))
            return context.get_dummy_value()

        return sig, codegen

    return mxfp4_block


_DECODE = _decode_avx512 if _host_has_avx512() else _decode_generic
_mxfp4_row = _make_mxfp4_block(_DECODE, 1, 1)
MX_BLOCK_ROWS = 2
MX_TOKEN_BLOCKS = (4, 2, 1)
_mxfp4_block4, _mxfp4_block2, _mxfp4_block1 = (
    _make_mxfp4_block(_DECODE, MX_BLOCK_ROWS, n) for n in MX_TOKEN_BLOCKS)
MX_ROWS_PER_TASK = 64


def _mxfp4_matmul(packed, scale, xe, xo, out, scales):
    """x arrives split into even (low nibble) and odd (high nibble) columns. One token:
    a row at a time, straight from memory. Several: a task's rows × blocks of 4, then 2,
    then 1 tokens (every output the same bits either way)."""
    rows = packed.shape[0]
    tokens = xe.shape[0]
    n_tasks = (rows + MX_ROWS_PER_TASK - 1) // MX_ROWS_PER_TASK
    for task in prange(n_tasks):
        lo = task * MX_ROWS_PER_TASK
        hi = min(rows, lo + MX_ROWS_PER_TASK)
        if tokens == 1:
            for r in range(lo, hi):
                _mxfp4_row(packed, r, 1, xe, xo, 0, 1, scale, scales, out)
            continue
        t = 0
        while t < tokens:
            left = tokens - t
            for r in range(lo, hi, MX_BLOCK_ROWS):
                valid = min(MX_BLOCK_ROWS, hi - r)
                if left >= 4:
                    _mxfp4_block4(packed, r, valid, xe, xo, t, 4, scale, scales, out)
                elif left >= 2:
                    _mxfp4_block2(packed, r, valid, xe, xo, t, 2, scale, scales, out)
                else:
                    _mxfp4_block1(packed, r, valid, xe, xo, t, 1, scale, scales, out)
            t += 4 if left >= 4 else 2 if left >= 2 else 1


# ---- BF16 row dot product, the same way ------------------------------------------------------
_BF16_CHAINS = 4  # independent 16-lane accumulators: enough to hide the FMA latency


def _emit_bf16_dot(builder, cols, xrow, chunk_bits, col_bits, prefetch):
    """Σ_j W[j]·x[j] over `cols` columns in the BF16 row dot's order (see _bf16_row_dot),
    the weights given as float32 bits (BF16 bits << 16): chunk_bits(j) → <16 x i32> for
    columns j..j+15 and col_bits(j) → i32 for column j, both called in increasing j;
    prefetch(j0) before each 64-column block. Any source of the same bits gives the same
    float32."""
    ity = cols.type
    accs = [
        cgutils.alloca_once_value(builder, ir.Constant(_VF, None)) for _ in range(_BF16_CHAINS)
    ]

    def chunk(j, acc):  # 16 columns from column j
        wf = builder.bitcast(chunk_bits(j), _VF)
        xf = builder.load(builder.bitcast(builder.gep(xrow, [j]), _VF.as_pointer()), align=4)
        builder.store(_vfma(builder, wf, xf, builder.load(acc)), acc)

    block = ir.Constant(ity, _LANES * _BF16_CHAINS)
    with cgutils.for_range(builder, builder.udiv(cols, block)) as loop:
        j0 = builder.mul(loop.index, block)
        prefetch(j0)
        for c, acc in enumerate(accs):
            chunk(builder.add(j0, ir.Constant(ity, c * _LANES)), acc)
    done = builder.mul(builder.udiv(cols, block), block)
    lanes16 = ir.Constant(ity, _LANES)
    n_chunks = builder.udiv(builder.sub(cols, done), lanes16)
    with cgutils.for_range(builder, n_chunks) as loop:
        chunk(builder.add(done, builder.mul(loop.index, lanes16)), accs[0])
    v = builder.fadd(
        builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
        builder.fadd(builder.load(accs[2]), builder.load(accs[3])),
    )
    total = cgutils.alloca_once_value(builder, _lane_sum(builder, v))
    rest = builder.add(done, builder.mul(n_chunks, lanes16))
    fma1 = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32"
    )
    with cgutils.for_range(builder, builder.sub(cols, rest)) as loop:
        j = builder.add(rest, loop.index)
        wf = builder.bitcast(col_bits(j), _F32)
        builder.store(
            builder.call(fma1, [wf, builder.load(builder.gep(xrow, [j])), builder.load(total)]),
            total,
        )
    return builder.load(total)


def _prefetch_ahead(builder, row, j0, nbytes: int, distance: int) -> None:
    """Prefetch the `nbytes` (whole cache lines) at byte j0 + distance of `row`."""
    prefetch = _prefetch_fn(builder)
    base = builder.bitcast(row, ir.IntType(8).as_pointer())
    for c in range(0, nbytes, 64):
        ahead = builder.add(j0, ir.Constant(j0.type, distance + c))
        builder.call(prefetch, [builder.gep(base, [ahead]), *_PREFETCH_READ_L1])


@intrinsic
def _bf16_row_dot(typingctx, w, r, x, t):
    """Σ_j W[r, j]·x[t, j] for a BF16 row (uint16 bits, widened exactly by a 16-bit shift).
    Chunk c of 16 columns goes to accumulator c mod 4 for the whole 64-column blocks;
    leftover 16-column chunks go to accumulator 0; then (acc0 + acc1) + (acc2 + acc3), a
    halving tree over the lanes, and the last < 16 columns one by one."""
    sig = types.float32(w, r, x, t)

    def codegen(context, builder, signature, args):
        wv, r, xv, t = args
        wty, _, xty, _ = signature.args
        zero = ir.Constant(r.type, 0)
        warr = context.make_array(wty)(context, builder, wv)
        cols = cgutils.unpack_tuple(builder, warr.shape, 2)[1]
        wrow = cgutils.get_item_pointer(context, builder, wty, warr, [r, zero])
        xrow = cgutils.get_item_pointer(
            context, builder, xty, context.make_array(xty)(context, builder, xv), [t, zero]
        )

        def chunk_bits(j):  # widened exactly by a 16-bit shift
            bits = builder.load(
                builder.bitcast(builder.gep(wrow, [j]), _VI16.as_pointer()), align=2
            )
            return builder.shl(builder.zext(bits, _VI32), _splat(_VI32, 16))

        def col_bits(j):
            bits = builder.zext(builder.load(builder.gep(wrow, [j])), ir.IntType(32))
            return builder.shl(bits, ir.Constant(ir.IntType(32), 16))

        def prefetch(j0):  # two cache lines of bits per 64-column block
            _prefetch_ahead(builder, wrow, builder.mul(j0, ir.Constant(j0.type, 2)), 128,
                            PREFETCH_BYTES)

        return _emit_bf16_dot(builder, cols, xrow, chunk_bits, col_bits, prefetch)

    return sig, codegen


def _make_bf16_block(n_rows: int, n_tokens: int):
    """An intrinsic over a block of `n_rows` BF16 rows × `n_tokens` tokens and the 64-column
    blocks b0..b1 of their rows: out[t0 + t, c0 + i] = Σ_j W[r0 + i, j]·x[t0 + t, j], each
    output in _bf16_row_dot's order. Per chain (chunk c of each 64-column block) the
    n_rows·n_tokens accumulators live in registers for a pass over the blocks, so each
    widened 16-lane weight vector feeds every token and each x vector every row. The four
    chains' accumulators are kept in `acc` (float32, from offset a0, 4·rows·tokens vectors)
    between calls: a row is taken in column panels whose x stays in cache across a task's
    rows. b0 = 0 starts the sums; `last` ends them: leftover chunks into acc0, then
    (acc0 + acc1) + (acc2 + acc3), the lane tree and the last < 16 columns one by one,
    exactly as for one token. Rows past `valid` and tokens past `tvalid` repeat the last
    valid one (the same value to the same place), so a block may overhang the matrix."""

    @intrinsic
    def bf16_block(typingctx, w, r0, c0, valid, x, t0, tvalid, out, acc, a0, b0, b1, last):
        sig = types.none(w, r0, c0, valid, x, t0, tvalid, out, acc, a0, b0, b1, last)

        def codegen(context, builder, signature, args):
            wv, r0, c0, valid, xv, t0, tvalid, res, accv, a0, b0, b1, last = args
            wty, _, _, _, xty, _, _, resty, accty = signature.args[:9]
            ity = r0.type
            zero = ir.Constant(ity, 0)
            warr = context.make_array(wty)(context, builder, wv)
            xarr = context.make_array(xty)(context, builder, xv)
            rarr = context.make_array(resty)(context, builder, res)
            abase = builder.gep(context.make_array(accty)(context, builder, accv).data, [a0])
            cols = cgutils.unpack_tuple(builder, warr.shape, 2)[1]
            rows = _clamped(builder, n_rows, valid)
            wrows = [cgutils.get_item_pointer(context, builder, wty, warr,
                                              [builder.add(r0, i), zero]) for i in rows]
            toks = [builder.add(t0, t) for t in _clamped(builder, n_tokens, tvalid)]
            xrows = [cgutils.get_item_pointer(context, builder, xty, xarr, [t, zero])
                     for t in toks]
            pairs = [(i, t) for i in range(n_rows) for t in range(n_tokens)]
            reg = {p: cgutils.alloca_once(builder, _VF) for p in pairs}

            def kept(c, k):  # chain c's accumulator of pair k in `acc`
                at = ir.Constant(ity, (c * len(pairs) + k) * _LANES)
                return builder.bitcast(builder.gep(abase, [at]), _VF.as_pointer())

            lanes16 = ir.Constant(ity, _LANES)
            block = ir.Constant(ity, _LANES * _BF16_CHAINS)
            n_blocks = builder.udiv(cols, block)
            done = builder.mul(n_blocks, block)
            n_chunks = builder.udiv(builder.sub(cols, done), lanes16)
            fresh = builder.icmp_signed("==", b0, zero)
            ending = builder.icmp_signed("!=", last, ir.Constant(last.type, 0))

            def chunk(j):  # every pair's accumulator += W[i, j:j+16]·x[t, j:j+16]
                ws = []
                for wrow in wrows:
                    bits = builder.load(
                        builder.bitcast(builder.gep(wrow, [j]), _VI16.as_pointer()), align=2)
                    ws.append(builder.bitcast(
                        builder.shl(builder.zext(bits, _VI32), _splat(_VI32, 16)), _VF))
                for t, xrow in enumerate(xrows):
                    xf = builder.load(builder.bitcast(builder.gep(xrow, [j]), _VF.as_pointer()),
                                      align=4)
                    for i in range(n_rows):
                        builder.store(_vfma(builder, ws[i], xf, builder.load(reg[i, t])),
                                      reg[i, t])

            for c in range(_BF16_CHAINS):
                for k, p in enumerate(pairs):
                    builder.store(builder.select(fresh, ir.Constant(_VF, None),
                                                 builder.load(kept(c, k), align=4)), reg[p])
                with cgutils.for_range(builder, builder.sub(b1, b0)) as loop:
                    b = builder.add(b0, loop.index)
                    chunk(builder.add(builder.mul(b, block), ir.Constant(ity, c * _LANES)))
                if c == 0:  # leftover 16-column chunks go to accumulator 0, after the blocks
                    with builder.if_then(ending):
                        with cgutils.for_range(builder, n_chunks) as loop:
                            chunk(builder.add(done, builder.mul(loop.index, lanes16)))
                for k, p in enumerate(pairs):
                    builder.store(builder.load(reg[p]), kept(c, k), align=4)
            with builder.if_then(ending):
                rest = builder.add(done, builder.mul(n_chunks, lanes16))
                fma1 = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
                for k, (i, t) in enumerate(pairs):
                    a = [builder.load(kept(c, k), align=4) for c in range(_BF16_CHAINS)]
                    v = builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3]))
                    total = cgutils.alloca_once_value(builder, _lane_sum(builder, v))
                    with cgutils.for_range(builder, builder.sub(cols, rest)) as loop:
                        j = builder.add(rest, loop.index)
                        bits = builder.zext(builder.load(builder.gep(wrows[i], [j])),
                                            ir.IntType(32))
                        wf = builder.bitcast(builder.shl(bits, ir.Constant(ir.IntType(32), 16)),
                                             _F32)
                        xj = builder.load(builder.gep(xrows[t], [j]))
                        builder.store(builder.call(fma1, [wf, xj, builder.load(total)]), total)
                    builder.store(builder.load(total), cgutils.get_item_pointer(
                        context, builder, resty, rarr, [toks[t], builder.add(c0, rows[i])]))
            return context.get_dummy_value()

        return sig, codegen

    return bf16_block


def _bf16_matmul(w, x, out):  # w uint16 [R, C], x f32 [T, C], out f32 [T, R]
    """A decode step's token (or two or three): each row once, straight from memory, its
    row dot for each token while it is in cache."""
    rows = w.shape[0]
    tokens = x.shape[0]
    n_tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            for t in range(tokens):
                out[t, r] = _bf16_row_dot(w, r, x, t)


# Several tokens: blocks of 4 rows × 4 tokens (16 accumulators in registers), rows taken in
# panels of 1024 columns so a panel of a block of tokens' x stays in cache over a task's rows
# (measured on Zen 4: 4 × 4 beat 4 × 6, 6 × 4, 2 × 8; panels of 1024 beat 512, 2048, whole).
BLOCK_ROWS, BLOCK_TOKENS, PANEL_BLOCKS = 4, 4, 16
_ACC_FLOATS = _BF16_CHAINS * BLOCK_ROWS * BLOCK_TOKENS * _LANES  # one block's kept chains
_bf16_block = _make_bf16_block(BLOCK_ROWS, BLOCK_TOKENS)


def blocks_pay(tokens: int) -> bool:
    """Below a block of tokens the row dots stream each row once and compute no padding
    (2 tokens: ~7 vs ~9 ms for a [3584, 7168] BF16 product here); from a block on the
    blocks win (8 tokens: ~12 vs ~20 ms)."""
    return tokens >= BLOCK_TOKENS


def _bf16_tiles(w, r0, r1, c0, x, out, acc):
    """out[:, c0 + r − r0] for rows r0..r1 of the BF16 bits `w` and every token of x, in
    blocks (`acc` holds the task's blocks' chains between panels)."""
    tokens = x.shape[0]
    n_blocks = w.shape[1] // (_LANES * _BF16_CHAINS)
    for t in range(0, tokens, BLOCK_TOKENS):
        b = 0
        while True:
            e = min(n_blocks, b + PANEL_BLOCKS)
            k = 0
            for r in range(r0, r1, BLOCK_ROWS):
                _bf16_block(w, r, c0 + r - r0, min(BLOCK_ROWS, r1 - r), x, t, tokens - t, out,
                            acc, k * _ACC_FLOATS, b, e, e == n_blocks)
                k += 1
            b = e
            if b >= n_blocks:
                break


def _bf16_matmul_tokens(w, x, out):  # w uint16 [R, C], x f32 [T, C], out f32 [T, R]
    rows = w.shape[0]
    n_tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        acc = np.empty(ROWS_PER_TASK // BLOCK_ROWS * _ACC_FLOATS, np.float32)
        r0 = task * ROWS_PER_TASK
        _bf16_tiles(w, r0, min(rows, r0 + ROWS_PER_TASK), r0, x, out, acc)


def _build(fn, parallel: bool, exact: bool = False):
    """Compile `fn` serial or parallel (`prange` is a plain range in the serial build, so
    both compute every output element with the same instruction sequence). Each build
    gets its own function name: numba's on-disk cache is keyed by the function, and
    sharing one would hand the parallel caller the serial machine code."""
    name = f"{fn.__name__}_{'parallel' if parallel else 'serial'}"
    clone = pytypes.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = name
    # the BF16 and MXFP4 kernels' order is spelled out in their IR (`exact`: a kernel that
    # calls theirs): no fast-math licence
    exact = exact or fn in (_mxfp4_matmul, _bf16_matmul, _bf16_matmul_tokens)
    flags = dict(_FLAGS, fastmath=False) if exact else _FLAGS
    return njit(parallel=parallel, **flags)(clone)


_bf16_tiles = njit(**dict(_FLAGS, fastmath=False))(_bf16_tiles)
_KERNELS = {
    (fn.__name__, parallel): _build(fn, parallel)
    for fn in (_bf16_matmul, _bf16_matmul_tokens, _f32_matmul, _mxfp4_matmul)
    for parallel in (False, True)
}


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    par = w.size >= PARALLEL_MIN_WEIGHTS  # by matrix only: a step and a prefill agree
    if w.dtype == np.uint16:
        _KERNELS[("_bf16_matmul_tokens" if blocks_pay(x.shape[0]) else "_bf16_matmul", par)](
            w, x, out)
    else:
        _KERNELS[("_f32_matmul", par)](w, x, out)
    return out


def mxfp4_linear(
    x: np.ndarray, packed: np.ndarray, scale: np.ndarray, parallel: bool | None = None
) -> np.ndarray:
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
        _KERNELS[("_bf16_matmul_tokens", parallel)](np.zeros((2, 64), np.uint16), x, out)
        _KERNELS[("_f32_matmul", parallel)](np.zeros((2, 64), np.float32), x, out)
        _KERNELS[("_mxfp4_matmul", parallel)](
            np.zeros((2, 16), np.uint8),
            np.zeros((2, 1), np.uint8),
            x[:, :16],
            x[:, :16],
            out,
            MX_SCALE,
        )


def set_threads(n: int) -> None:
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
