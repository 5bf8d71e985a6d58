"""Decode attention over the paged KV pool on the CPU: one request's query heads of one KV head
(a GQA group) against the K/V rows in its slots, for the fused decode layer
(`shoal.kernels.fused_decode`) and the op-by-op decode attention (`shoal.kernels.decode_attention`).

Written as numba loops, the scores took a dot product per (token, head), each ending in a
horizontal sum of a vector, and the weighted sum of V loaded and stored each head's output for
every token. Here, in LLVM IR (numba intrinsics, as `shoal.kernels.panel_products` writes its
tile):

- the scores of `VECTOR` tokens at a time: one head's query, a vector at a time, times each
  token's K row, into a vector of partial sums per token; the `VECTOR` partial vectors are added
  up in one transposing tree of shuffles (`_lane_sums`), so each token's sum lands in its own
  lane, with no horizontal add per token; while a block runs, the K and V rows of the next block
  are fetched from memory;
- the weighted sum of V a vector of the head dimension at a time, for up to `_GROUP_BLOCK` heads
  of the group at once: their sums stay in registers over every token (two sets, alternate
  tokens, so that consecutive multiply-adds do not wait on each other), each V vector read once
  for them, the row `PREFETCH_AHEAD` tokens on asked for meanwhile.

Against the numba loops this replaced it runs attention in about half the time with the K/V in
cache and in less with a request's slots scattered over the pool (docs/perf-log.md).

The softmax between them is numba's, on the exp that vectorizes. A head dimension that is not a
multiple of `VECTOR` takes plain numba loops. Sums are taken in another order than SDPA's.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as numba_types
from numba.extending import intrinsic

from shoal.kernels.numba_kernels import PREFETCH_AHEAD, exp_in_place, prefetch_ahead
from shoal.kernels.vector_ir import (
    F32,
    I32,
    I64,
    VEC,
    VECTOR,
    broadcast,
    by_count,
    fma,
    i64,
    prefetch,
    vector_at,
    zeros,
)

# Heads of a group whose weighted sums of V are kept in registers at once (x 2 sets).
_GROUP_BLOCK = 4
_LINE_FLOATS = 16


def _lane_sums(builder: ir.IRBuilder, vectors: list[ir.Value]) -> ir.Value:
    """`VECTOR` vectors -> one vector whose lane i is the sum of the lanes of vectors[i]: each
    level adds the low and high halves of every token's lanes, two vectors into one."""
    level, lanes = vectors, VECTOR
    while lanes > 1:
        half = lanes // 2
        tokens = VECTOR // lanes
        low = [t * lanes + i for t in range(tokens) for i in range(half)]
        low = low + [VECTOR + at for at in low]
        high = [at + half for at in low]
        mask_low = ir.Constant(ir.VectorType(I32, VECTOR), low)
        mask_high = ir.Constant(ir.VectorType(I32, VECTOR), high)
        level = [builder.fadd(builder.shuffle_vector(a, b, mask_low),
                              builder.shuffle_vector(a, b, mask_high))
                 for a, b in zip(level[0::2], level[1::2])]
        lanes = half
    return level[0]


def _smin(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    return builder.select(builder.icmp_signed("<", a, b), a, b)


def _slot_row(builder: ir.IRBuilder, table: Any, table_row: ir.Value, t: ir.Value,
              pool: Any, kv: ir.Value) -> ir.Value:
    """Pointer to pool[table[table_row, t], kv] (a row of `dim` floats)."""
    columns = cgutils.unpack_tuple(builder, table.shape)[1]
    slot = builder.load(builder.gep(table.data, [builder.add(builder.mul(table_row, columns),
                                                                 t)]))
    slot = builder.sext(slot, I64) if slot.type.width < 64 else slot
    kv_heads, dim = cgutils.unpack_tuple(builder, pool.shape)[1:]
    return builder.gep(pool.data, [builder.mul(builder.add(builder.mul(slot, kv_heads), kv),
                                               dim)])


def _arrays_ok(*arrays: numba_types.Type) -> bool:
    return all(isinstance(a, numba_types.Array) and a.layout == "C" for a in arrays)


@intrinsic
def _scores(typingctx: Any, k_pool: numba_types.Type, v_pool: numba_types.Type,
            q: numba_types.Type, table: numba_types.Type, scores: numba_types.Type,
            row: numba_types.Type, table_row: numba_types.Type, kv: numba_types.Type,
            start: numba_types.Type, n: numba_types.Type, scale: numba_types.Type) -> Any:
    """scores[g, start + i] = (q[row, (kv * group + g) * dim:][:dim] . K of token start + i) *
    scale for i < min(VECTOR, n - start) and every g < group = scores.shape[0], K of token t
    being k_pool[table[table_row, t], kv]; fetches the K and V rows of the next block
    meanwhile (the weighted sum of V reads them next). C-contiguous k_pool / v_pool [slots,
    kv_heads, dim], q [rows, heads * dim], scores [group, >= n] float32, table [rows, context]
    integer; dim a multiple of VECTOR."""
    if not _arrays_ok(k_pool, v_pool, q, table, scores) or not isinstance(
            table.dtype, numba_types.Integer) or not all(
            a.dtype == numba_types.float32 for a in (k_pool, v_pool, q, scores)):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        pool_a, v_pool_a, q_a, table_a, scores_a = (
            context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:5], args[:5]))
        row_i, table_row_i, kv_i, start_i, n_i = (
            context.cast(builder, a, t, numba_types.int64)
            for a, t in zip(args[5:10], sig.args[5:10]))
        scale_v = broadcast(builder, context.cast(builder, args[10], sig.args[10],
                                                   numba_types.float32))
        dim = cgutils.unpack_tuple(builder, pool_a.shape)[2]
        group, columns = cgutils.unpack_tuple(builder, scores_a.shape)
        width = cgutils.unpack_tuple(builder, q_a.shape)[1]
        multiply_add = fma(builder)
        last = builder.sub(_smin(builder, builder.add(start_i, i64(VECTOR)), n_i), i64(1))
        rows = [_slot_row(builder, table_a, table_row_i,
                          _smin(builder, builder.add(start_i, i64(i)), last), pool_a, kv_i)
                for i in range(VECTOR)]

        final = builder.sub(n_i, i64(1))
        for i in range(VECTOR):
            ahead = _smin(builder, builder.add(start_i, i64(VECTOR + i)), final)
            at = _slot_row(builder, table_a, table_row_i, ahead, pool_a, kv_i)
            v_at = _slot_row(builder, table_a, table_row_i, ahead, v_pool_a, kv_i)
            with cgutils.for_range_slice(builder, i64(0), dim, i64(_LINE_FLOATS)) as (d, _):
                prefetch(builder, builder.gep(at, [d]), locality=3)
                prefetch(builder, builder.gep(v_at, [d]), locality=3)

        q_row = builder.gep(q_a.data, [builder.add(builder.mul(row_i, width),
                                                   builder.mul(builder.mul(kv_i, group), dim))])
        sums = [cgutils.alloca_once(builder, VEC) for _ in range(VECTOR)]
        lanes = cgutils.alloca_once(builder, VEC)
        count = builder.add(builder.sub(last, start_i), i64(1))
        with cgutils.for_range(builder, group) as head:
            for s in sums:
                builder.store(zeros(), s)
            q_head = builder.gep(q_row, [builder.mul(head.index, dim)])
            with cgutils.for_range_slice(builder, i64(0), dim, i64(VECTOR)) as (d, _):
                query = builder.load(vector_at(builder, q_head, d), align=4)
                for s, k_row in zip(sums, rows):
                    key = builder.load(vector_at(builder, k_row, d), align=4)
                    builder.store(builder.call(multiply_add, [query, key, builder.load(s)]), s)
            total = _lane_sums(builder, [builder.load(s) for s in sums])
            builder.store(builder.fmul(total, scale_v), lanes)
            out_row = builder.gep(scores_a.data, [builder.add(
                builder.mul(head.index, columns), start_i)])
            lane_floats = builder.bitcast(lanes, F32.as_pointer())
            with cgutils.for_range(builder, count) as i:
                builder.store(builder.load(builder.gep(lane_floats, [i.index])),
                              builder.gep(out_row, [i.index]))
        return context.get_dummy_value()

    sig = numba_types.void(k_pool, v_pool, q, table, scores, row, table_row, kv, start, n,
                           scale)
    return sig, codegen


@intrinsic
def _weighted_values(typingctx: Any, v_pool: numba_types.Type, scores: numba_types.Type,
                     table: numba_types.Type, out: numba_types.Type, row: numba_types.Type,
                     table_row: numba_types.Type, kv: numba_types.Type,
                     n: numba_types.Type) -> Any:
    """out[row, (kv * group + g) * dim:][:dim] = sum over t < n of scores[g, t] * V of token t
    (v_pool[table[table_row, t], kv]) for every g < group = scores.shape[0]. C-contiguous
    v_pool [slots, kv_heads, dim], scores [group, >= n], out [rows, heads * dim] float32,
    table [rows, context] integer; dim a multiple of VECTOR."""
    if not _arrays_ok(v_pool, scores, table, out) or not isinstance(
            table.dtype, numba_types.Integer) or not all(
            a.dtype == numba_types.float32 for a in (v_pool, scores, out)):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        pool_a, scores_a, table_a, out_a = (context.make_array(t)(context, builder, a)
                                            for t, a in zip(sig.args[:4], args[:4]))
        row_i, table_row_i, kv_i, n_i = (context.cast(builder, a, t, numba_types.int64)
                                         for a, t in zip(args[4:8], sig.args[4:8]))
        dim = cgutils.unpack_tuple(builder, pool_a.shape)[2]
        group, columns = cgutils.unpack_tuple(builder, scores_a.shape)
        width = cgutils.unpack_tuple(builder, out_a.shape)[1]
        multiply_add = fma(builder)
        out_row = builder.gep(out_a.data, [builder.add(
            builder.mul(row_i, width), builder.mul(builder.mul(kv_i, group), dim))])
        final = builder.sub(n_i, i64(1))
        even = builder.mul(builder.sdiv(n_i, i64(2)), i64(2))
        sums = [[cgutils.alloca_once(builder, VEC) for _ in range(_GROUP_BLOCK)]
                for _ in range(2)]

        def block(first_head: ir.Value, heads: int, d: ir.Value) -> None:
            """The sums of heads [first_head, first_head + heads) at dimension offset d."""
            for half in sums:
                for s in half[:heads]:
                    builder.store(zeros(), s)

            def token(t: ir.Value, half: list[ir.Value]) -> None:
                ahead = _slot_row(builder, table_a, table_row_i, _smin(
                    builder, builder.add(t, i64(PREFETCH_AHEAD)), final), pool_a, kv_i)
                prefetch(builder, builder.gep(ahead, [d]), locality=3)
                value = builder.load(vector_at(builder, _slot_row(
                    builder, table_a, table_row_i, t, pool_a, kv_i), d), align=4)
                for h, s in enumerate(half[:heads]):
                    weight = builder.load(builder.gep(scores_a.data, [builder.add(
                        builder.mul(builder.add(first_head, i64(h)), columns), t)]))
                    builder.store(builder.call(multiply_add, [
                        broadcast(builder, weight), value, builder.load(s)]), s)

            with cgutils.for_range_slice(builder, i64(0), even, i64(2)) as (t, _):
                token(t, sums[0])
                token(builder.add(t, i64(1)), sums[1])
            with builder.if_then(builder.icmp_signed("<", even, n_i)):
                token(even, sums[0])
            for h in range(heads):
                at = builder.add(builder.mul(builder.add(first_head, i64(h)), dim), d)
                builder.store(builder.fadd(builder.load(sums[0][h]), builder.load(sums[1][h])),
                              vector_at(builder, out_row, at), align=4)

        with (cgutils.for_range_slice(builder, i64(0), dim, i64(VECTOR)) as (d, _),
              cgutils.for_range_slice(builder, i64(0), group, i64(_GROUP_BLOCK)) as (first, _)):
            left = _smin(builder, builder.sub(group, first), i64(_GROUP_BLOCK))
            by_count(builder, left, _GROUP_BLOCK, "heads",
                     lambda heads: block(first, heads, d))
        return context.get_dummy_value()

    return numba_types.void(v_pool, scores, table, out, row, table_row, kv, n), codegen


@numba.njit(inline="always")
def attend_group(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, table: np.ndarray,
                 table_row: int, row: int, kv: int, n: int, group: int, scale: np.float32,
                 out: np.ndarray) -> None:
    """out[row, heads of KV head kv] = softmax(q[row, those heads] K^T * scale) V over the first
    n slots of table[table_row], for the `group` query heads of KV head `kv` (inlined, numba IR,
    into the kernels that run one (request, KV head) a task). q and out [rows, heads * dim],
    k_pool / v_pool [slots, kv_heads, dim]: C-contiguous float32."""
    dim = k_pool.shape[2]
    first = kv * group * dim
    scores = np.empty((group, n), np.float32)
    if dim % VECTOR == 0:
        for start in range(0, n, VECTOR):
            _scores(k_pool, v_pool, q, table, scores, row, table_row, kv, start, n, scale)
    else:
        slots = table[table_row]
        for t in range(n):
            prefetch_ahead(k_pool, slots, t, n, kv)
            k_t = k_pool[slots[t], kv]
            for g in range(group):
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += q[row, first + g * dim + d] * k_t[d]
                scores[g, t] = acc * scale
    bits = np.empty(n, np.int32)
    for g in range(group):
        s = scores[g]
        s -= s.max()
        exp_in_place(s, bits)
        s /= s.sum()
    if dim % VECTOR == 0:
        _weighted_values(v_pool, scores, table, out, row, table_row, kv, n)
    else:
        slots = table[table_row]
        out[row, first:first + group * dim] = 0.0
        for t in range(n):
            prefetch_ahead(v_pool, slots, t, n, kv)
            v_t = v_pool[slots[t], kv]
            for g in range(group):
                p = scores[g, t]
                for d in range(dim):
                    out[row, first + g * dim + d] += p * v_t[d]
