"""The fused c12 matmul (numba): each 16-column chunk of a weight row is decoded in
registers from its compact form (16 sign+mantissa bytes, 8 bytes of 4-bit codes) into
BF16 bits and fed to the very same row dot (`_emit_bf16_dot`) as the BF16 kernel, so
every output element is summed in the same order and is bit-identical to the BF16
product of the decoded weights. The code → exponent lookup is one byte shuffle per
16 lanes (pshufb) where numba compiles for an x86 host, else a select tree. A row's
exceptions (sorted by column, checked when read) are patched into the chunk they fall
in; a chunk without one costs a single compare. The weight bytes are read once,
12 bits each, sequentially per row.
"""

from __future__ import annotations

import contextlib

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import cgutils, types
from numba.core.extending import intrinsic

from engine.kernels.compact import CompactMatrix
from engine.kernels.fused import (
    _ACC_FLOATS,
    _LANES,
    _VI8,
    _VI16,
    _VI32,
    BLOCK_ROWS,
    PARALLEL_MIN_WEIGHTS,
    PREFETCH_BYTES,
    ROWS_PER_TASK,
    _bf16_tiles,
    _build,
    _emit_bf16_dot,
    _prefetch_ahead,
    _splat,
    blocks_pay,
)

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
# codes byte k holds columns 2k (low nibble) and 2k+1 (high): interleave the two halves
_INTERLEAVE = ir.Constant(ir.VectorType(_I32, _LANES), [k // 2 + 8 * (k % 2) for k in range(16)])


def _host_has(feature: str) -> bool:
    """Whether numba compiles for this very CPU (NUMBA_CPU_NAME unset) and it has `feature`."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get(feature))
    except RuntimeError:  # features unknown on this platform: the select tree is always right
        return False


def _widen(builder, sm, exp16):
    """sign+mantissa bytes and exponent bits (<16 x i16>, BF16 position) → float32 bits."""
    s16 = builder.zext(sm, _VI16)
    bits = builder.or_(builder.or_(
        builder.shl(builder.and_(s16, _splat(_VI16, 0x80)), _splat(_VI16, 8)),
        builder.and_(s16, _splat(_VI16, 0x7F))), exp16)
    return builder.shl(builder.zext(bits, _VI32), _splat(_VI32, 16))


def _lookup_vpermd(builder, table):
    """AVX-512: vpermd looks up 16 float32 exponents at once (it reads only an index's low
    4 bits); the sign-extended byte << 16 puts the sign at bit 31 and the mantissa at 16..22."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_VI32, [_VI32, _VI32]), "llvm.x86.avx512.permvar.si.512"
    )
    t32 = builder.shl(builder.zext(table, _VI32), _splat(_VI32, 16))

    def lookup(idx, sm):
        exp = builder.call(fn, [t32, builder.zext(idx, _VI32)])
        s = builder.shl(builder.sext(sm, _VI32), _splat(_VI32, 16))
        return builder.or_(builder.and_(s, _splat(_VI32, 0x807F0000)), exp)

    return lookup


def _lookup_pshufb(builder, table):
    """SSSE3: the table's high and low bytes each looked up by one pshufb."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_VI8, [_VI8, _VI8]), "llvm.x86.ssse3.pshuf.b.128"
    )
    hi = builder.trunc(builder.lshr(table, _splat(_VI16, 8)), _VI8)
    lo = builder.trunc(table, _VI8)

    def lookup(idx, sm):
        idx = builder.and_(idx, _splat(_VI8, 15))  # pshufb zeroes a lane whose bit 7 is set
        eh = builder.zext(builder.call(fn, [hi, idx]), _VI16)
        exp = builder.or_(builder.shl(eh, _splat(_VI16, 8)),
                          builder.zext(builder.call(fn, [lo, idx]), _VI16))
        return _widen(builder, sm, exp)

    return lookup


def _lookup_select(builder, table):
    """The same lookup as a binary tree of 15 selects on the code's bits (any target)."""
    entries = [builder.shuffle_vector(table, table, ir.Constant(ir.VectorType(_I32, _LANES),
                                                                [k] * _LANES))
               for k in range(16)]

    def lookup(idx, sm):
        level = entries
        for bit in range(4):
            on = builder.icmp_unsigned("!=", builder.and_(idx, _splat(_VI8, 1 << bit)),
                                       _splat(_VI8, 0))
            level = [builder.select(on, level[i + 1], level[i]) for i in range(0, len(level), 2)]
        return _widen(builder, sm, level[0])

    return lookup


def _best_lookup():
    if _host_has("avx512f"):
        return _lookup_vpermd
    return _lookup_pshufb if _host_has("ssse3") else _lookup_select


@contextlib.contextmanager
def _while(builder, cond):
    """`while cond(): body` in IR (cond builds the i1 at the top of each pass)."""
    top, body, done = (builder.append_basic_block(n) for n in ("while.top", "while.body",
                                                               "while.done"))
    builder.branch(top)
    builder.position_at_end(top)
    builder.cbranch(cond(), body, done)
    builder.position_at_end(body)
    yield
    builder.branch(top)
    builder.position_at_end(done)


def _c12_row(context, builder, signature, args, make_lookup):
    """Row r (args[6]) of a c12 matrix (args[:6]) as the BF16 row dot's callbacks: cols and
    chunk_bits(j), col_bits(j) (float32 bits, called in increasing j: a row's exceptions
    are patched in as a cursor passes them) and prefetch(j0). args[7] (an array) and
    args[8] (an index) belong to the caller."""
    tab, sma, cda, rpa, eca, eva = (context.make_array(ty)(context, builder, v)
                                    for ty, v in zip(signature.args[:6], args[:6]))
    r = args[6]
    ity = r.type
    zero = ir.Constant(ity, 0)

    def row_of(i, arr, row):
        return cgutils.get_item_pointer(context, builder, signature.args[i], arr,
                                        [row, zero])

    cols = cgutils.unpack_tuple(builder, sma.shape, 2)[1]
    smrow, cdrow = row_of(1, sma, r), row_of(2, cda, r)
    table = builder.load(builder.bitcast(tab.data, _VI16.as_pointer()), align=2)
    lookup = make_lookup(builder, table)
    e_end = builder.load(builder.gep(rpa.data, [builder.add(r, ir.Constant(ity, 1))]))
    exc = cgutils.alloca_once_value(builder, builder.load(builder.gep(rpa.data, [r])))
    nxt = cgutils.alloca_once_value(builder, cols)  # next exception's column, or cols
    patch = cgutils.alloca_once(builder, _VI32)

    def refill():
        e = builder.load(exc)
        with builder.if_then(builder.icmp_signed("<", e, e_end)):
            builder.store(builder.sext(builder.load(builder.gep(eca.data, [e])), ity), nxt)

    def take():  # the next exception's float32 bits; advance
        e = builder.load(exc)
        val = builder.shl(builder.zext(builder.load(builder.gep(eva.data, [e])), _I32),
                          ir.Constant(_I32, 16))
        builder.store(cols, nxt)
        builder.store(builder.add(e, ir.Constant(ity, 1)), exc)
        refill()
        return val

    refill()

    def chunk_bits(j):
        smb = builder.load(builder.bitcast(builder.gep(smrow, [j]), _VI8.as_pointer()),
                           align=1)
        half = builder.lshr(j, ir.Constant(ity, 1))
        vi8x8 = ir.VectorType(_I8, 8)
        cb = builder.load(builder.bitcast(builder.gep(cdrow, [half]),
                                          vi8x8.as_pointer()), align=1)
        # lane 2k: byte k (its low nibble is the code), lane 2k+1: byte k >> 4
        idx = builder.shuffle_vector(cb, builder.lshr(cb, ir.Constant(vi8x8, [4] * 8)),
                                     _INTERLEAVE)
        bits = lookup(idx, smb)
        end = builder.add(j, ir.Constant(ity, _LANES))
        fast = builder.basic_block
        with builder.if_then(builder.icmp_signed("<", builder.load(nxt), end),
                             likely=False):
            builder.store(bits, patch)
            lanes = builder.bitcast(patch, _I32.as_pointer())

            def more():
                return builder.icmp_signed("<", builder.load(nxt), end)

            with _while(builder, more):
                # & 15: a lane of this chunk even if the columns were not sorted
                lane = builder.and_(builder.sub(builder.load(nxt), j),
                                    ir.Constant(ity, 15))
                builder.store(take(), builder.gep(lanes, [lane]))
            patched = builder.load(patch)
            slow = builder.basic_block
        merged = builder.phi(_VI32)
        merged.add_incoming(bits, fast)
        merged.add_incoming(patched, slow)
        return merged

    def col_bits(j):
        s = builder.zext(builder.load(builder.gep(smrow, [j])), _I16)
        c = builder.load(builder.gep(cdrow, [builder.lshr(j, ir.Constant(ity, 1))]))
        shift = builder.trunc(builder.shl(builder.and_(j, ir.Constant(ity, 1)),
                                          ir.Constant(ity, 2)), _I8)
        code = builder.and_(builder.lshr(c, shift), ir.Constant(_I8, 15))
        eb = builder.load(builder.gep(tab.data, [builder.zext(code, ity)]))
        bits = builder.or_(builder.or_(
            builder.shl(builder.and_(s, ir.Constant(_I16, 0x80)), ir.Constant(_I16, 8)),
            builder.and_(s, ir.Constant(_I16, 0x7F))), eb)
        out = cgutils.alloca_once_value(
            builder, builder.shl(builder.zext(bits, _I32), ir.Constant(_I32, 16)))
        with builder.if_then(builder.icmp_signed("==", builder.load(nxt), j),
                             likely=False):
            builder.store(take(), out)
        return builder.load(out)

    def prefetch(j0):  # per 64 columns: a line of sign+mantissa, half a line of codes
        _prefetch_ahead(builder, smrow, j0, 64, PREFETCH_BYTES)
        _prefetch_ahead(builder, cdrow, builder.lshr(j0, ir.Constant(ity, 1)), 32,
                        PREFETCH_BYTES // 2)

    return cols, chunk_bits, col_bits, prefetch


def _make_c12_row_dot(make_lookup):
    @intrinsic
    def c12_row_dot(typingctx, exp_bits, sm, codes, row_ptr, exc_col, exc_val, r, x, t):
        """Σ_j W[r, j]·x[t, j] for c12 row r, in the BF16 row dot's order. exp_bits must
        hold 16 entries; exc_col must be sorted within each row (from_bytes checks it)."""
        sig = types.float32(exp_bits, sm, codes, row_ptr, exc_col, exc_val, r, x, t)

        def codegen(context, builder, signature, args):
            cols, chunk_bits, col_bits, prefetch = _c12_row(context, builder, signature, args,
                                                            make_lookup)
            xty = signature.args[7]
            xrow = cgutils.get_item_pointer(
                context, builder, xty, context.make_array(xty)(context, builder, args[7]),
                [args[8], ir.Constant(args[6].type, 0)])
            return _emit_bf16_dot(builder, cols, xrow, chunk_bits, col_bits, prefetch)

        return sig, codegen

    return c12_row_dot


def _make_c12_row_decode(make_lookup):
    @intrinsic
    def c12_row_decode(typingctx, exp_bits, sm, codes, row_ptr, exc_col, exc_val, r, dst, k):
        """dst[k, :] = the BF16 bits of c12 row r, decoded as the row dot decodes them."""
        sig = types.none(exp_bits, sm, codes, row_ptr, exc_col, exc_val, r, dst, k)

        def codegen(context, builder, signature, args):
            cols, chunk_bits, col_bits, _ = _c12_row(context, builder, signature, args,
                                                     make_lookup)
            ity = args[6].type
            dty = signature.args[7]
            drow = cgutils.get_item_pointer(
                context, builder, dty, context.make_array(dty)(context, builder, args[7]),
                [args[8], ir.Constant(ity, 0)])
            lanes16 = ir.Constant(ity, _LANES)
            n_chunks = builder.udiv(cols, lanes16)
            with cgutils.for_range(builder, n_chunks) as loop:
                j = builder.mul(loop.index, lanes16)
                bits = builder.trunc(builder.lshr(chunk_bits(j), _splat(_VI32, 16)), _VI16)
                builder.store(bits, builder.bitcast(builder.gep(drow, [j]), _VI16.as_pointer()),
                              align=2)
            rest = builder.mul(n_chunks, lanes16)
            with cgutils.for_range(builder, builder.sub(cols, rest)) as loop:
                j = builder.add(rest, loop.index)
                bits = builder.lshr(col_bits(j), ir.Constant(_I32, 16))
                builder.store(builder.trunc(bits, _I16), builder.gep(drow, [j]))
            return context.get_dummy_value()

        return sig, codegen

    return c12_row_decode


_c12_row_dot = _make_c12_row_dot(_best_lookup())
_c12_row_decode = _make_c12_row_decode(_best_lookup())


def _c12_matmul(exp_bits, sm, codes, row_ptr, exc_col, exc_val, x, out):
    rows = sm.shape[0]
    tokens = x.shape[0]
    n_tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            for t in range(tokens):
                out[t, r] = _c12_row_dot(exp_bits, sm, codes, row_ptr, exc_col, exc_val, r, x, t)


def _c12_matmul_tokens(exp_bits, sm, codes, row_ptr, exc_col, exc_val, x, out):
    """Several tokens: a task's rows are decoded once into BF16 bits, then go through the
    BF16 kernel's blocks (the same bits as the row dot's decode, so the same results)."""
    rows, cols = sm.shape
    n_tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        bits = np.empty((ROWS_PER_TASK, cols), np.uint16)
        acc = np.empty(ROWS_PER_TASK // BLOCK_ROWS * _ACC_FLOATS, np.float32)
        r0 = task * ROWS_PER_TASK
        r1 = min(rows, r0 + ROWS_PER_TASK)
        for r in range(r0, r1):
            _c12_row_decode(exp_bits, sm, codes, row_ptr, exc_col, exc_val, r, bits, r - r0)
        _bf16_tiles(bits, 0, r1 - r0, r0, x, out, acc)


_KERNELS = {(fn.__name__, par): _build(fn, par, exact=True)
            for fn in (_c12_matmul, _c12_matmul_tokens) for par in (False, True)}


def _parts(w: CompactMatrix) -> tuple[np.ndarray, ...]:
    """The arrays the kernel indexes, contiguous, their shapes checked against each other."""
    rows, cols = w.shape
    n = w.exc_col.shape
    if (w.exp_bits.shape != (16,) or cols % 2 or w.codes.shape != (rows, cols // 2)
            or w.row_ptr.shape != (rows + 1,) or w.exc_val.shape != n):
        raise ValueError(f"c12 parts disagree for a matrix of shape {w.shape}")
    return tuple(np.ascontiguousarray(a, d) for a, d in (
        (w.exp_bits, np.uint16), (w.sm, np.uint8), (w.codes, np.uint8), (w.row_ptr, np.int64),
        (w.exc_col, np.int32), (w.exc_val, np.uint16)))


def c12_linear(x: np.ndarray, w: CompactMatrix) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    par = w.size >= PARALLEL_MIN_WEIGHTS  # the BF16 kernel's rule, so both split alike
    kernel = "_c12_matmul_tokens" if blocks_pay(x.shape[0]) else "_c12_matmul"
    _KERNELS[(kernel, par)](*_parts(w), x, out)
    return out


def warm_up() -> None:
    args = (np.zeros(16, np.uint16), np.zeros((2, 64), np.uint8), np.zeros((2, 32), np.uint8),
            np.zeros(3, np.int64), np.zeros(0, np.int32), np.zeros(0, np.uint16),
            np.zeros((1, 64), np.float32), np.empty((1, 2), np.float32))
    for kernel in _KERNELS.values():
        kernel(*args)
