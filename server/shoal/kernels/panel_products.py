"""Products of many rows on the CPU over a weight packed into panels, float32 or int8.

A decode batch of 16-64 rows (and a prefill chunk) is bound by its multiply-adds, not by reading
the weights, and the libraries' kernels reach well under what the cores can do there, against
what the same libraries reach on a large product (docs/perf-log.md). This is the register-blocked
kernel such libraries use for large products, sized for these: the weight [out, in] is packed
once, at load, into panels of `PANEL` output channels, each panel [in, PANEL] so that one step
over the input dimension reads `PANEL` consecutive weights; a tile of up to `TILE_ROWS` rows
keeps its `TILE_ROWS` x `PANEL` sums in registers, and each step broadcasts one activation per row
and multiplies it with the panel's step (two vectors of eight with AVX2, one of sixteen with
AVX-512), `TILE_ROWS` x `PANEL_VECTORS` vector multiply-adds for `PANEL_VECTORS` vector loads
and `TILE_ROWS` broadcasts. A tile of a few rows (a decode step of one to a few streams) has too
few sums to keep the multiply-adds busy, so it sums the input dimension in several lanes, added
at the end (faster streaming at one row, docs/perf-log.md). No sum needs a
horizontal add, and while a tile of `_FETCH_ROWS` rows or more runs, the same thread's next panel
is fetched from memory ahead of its use (a tile of fewer streams the panels faster on the CPU's
own prefetchers alone).

The tile is written in LLVM IR (`_tile`, a numba intrinsic): numba's loops do not keep a block of
vector sums in registers. An int8 panel is widened to float32 in registers as it is read, and a
tile's sums are multiplied by the per-channel scale as they are stored (ones for float32
weights), so an int8 weight takes float32 activations and sums in float32 as
`shoal.kernels.numba_products` does. The panels run in parallel over torch's thread count
(`shoal.kernels.numba_kernels.Twins`); the sums are taken in another order than `F.linear`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as numba_types
from numba.extending import intrinsic

from shoal.kernels.numba_kernels import Twins
from shoal.kernels.vector_ir import (
    F32,
    I32,
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

# A panel is PANEL output channels wide: PANEL_VECTORS vector registers of VECTOR floats. With
# AVX2, 6 x 2 sums, two weight vectors and a broadcast fill 15 of its 16 256-bit registers; with
# AVX-512 a panel is one register, and 24 rows' sums and the weight vector fit in its 32 (each
# broadcast a memory operand of its multiply-add): faster than AVX2's tile where AVX-512 runs
# (docs/perf-log.md).
PANEL = 16
TILE_ROWS = 24 if VECTOR == 16 else 6
PANEL_VECTORS = PANEL // VECTOR
# A multiply-add waits on the one before it into the same sum (4 cycles, two issued a cycle): a
# tile of few rows keeps too few sums to hide that, so it sums the input dimension in several
# lanes (every `lanes`-th step into each, added at the end), at least `_CHAINS` sums in all.
_CHAINS = 8
_LINE = 64
# A tile of fewer rows asks for no panel ahead: it streams the weights, and the CPU's own
# prefetchers keep up with that better alone: measured, asking for the next panel slowed one and
# two rows and sped up three and more (docs/perf-log.md).
_FETCH_ROWS = 3
_LINE_FLOATS = _LINE // 4
# Rows that share an L1 set evict each other only once they outnumber its ways (8 on current
# AMD and Intel cores): `by_panels` copies fewer rows than that into padded rows for nothing.
_WAYS = 8


def _lanes(rows: int) -> int:
    """How many lanes a tile of `rows` rows sums the input dimension in."""
    return max(1, _CHAINS // (rows * PANEL_VECTORS))


@dataclass(frozen=True)
class Panels:
    """A weight packed for `by_panels`: `weights` [panels, in, PANEL] (float32 or int8; the
    channels past `channels` are zeros) and `scale` [panels * PANEL] float32."""

    weights: np.ndarray
    scale: np.ndarray
    channels: int

    @classmethod
    def of(cls, weight: np.ndarray, scale: np.ndarray | None = None) -> Panels:
        """Pack a row-major weight [out, in] (float32, or int8 with its per-channel `scale`)."""
        channels, depth = weight.shape
        count = -(-channels // PANEL)
        padded = np.zeros((count * PANEL, depth), weight.dtype)
        padded[:channels] = weight
        scales = np.zeros(count * PANEL, np.float32)
        scales[:channels] = 1.0 if scale is None else scale
        panels = np.ascontiguousarray(padded.reshape(count, PANEL, depth).transpose(0, 2, 1))
        return cls(panels, scales, channels)

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.scale.nbytes


def _weights(builder: ir.IRBuilder, step: ir.Value, element: numba_types.Type
             ) -> list[ir.Value]:
    """The panel step at pointer `step` as PANEL_VECTORS float vectors (int8 widened)."""
    wide = ir.VectorType(F32, PANEL)
    if element == numba_types.int8:
        raw = builder.load(builder.bitcast(step, ir.VectorType(ir.IntType(8), PANEL).as_pointer()),
                           align=1)
        values = builder.sitofp(raw, wide)
    else:
        values = builder.load(builder.bitcast(step, wide.as_pointer()), align=4)
    return [builder.shuffle_vector(values, ir.Constant(wide, ir.Undefined), ir.Constant(
        ir.VectorType(I32, VECTOR), list(range(j * VECTOR, (j + 1) * VECTOR))))
        for j in range(PANEL_VECTORS)]


@intrinsic
def _tile(typingctx: Any, panels: numba_types.Type, x: numba_types.Type,
          scale: numba_types.Type, out: numba_types.Type, panel: numba_types.Type,
          row: numba_types.Type, rows: numba_types.Type, ahead: numba_types.Type) -> Any:
    """out[row:row + rows, panel's channels] = (x[row:row + rows] . panel) * its scale, for
    1 <= rows <= TILE_ROWS, asking for panel `ahead` from memory meanwhile (C-contiguous arrays:
    panels [count, in, PANEL] float32 or int8, x [m, >= in] (its first `in` columns read) and
    out [m, count * PANEL] float32)."""
    arrays = (panels, x, scale, out)
    if not all(isinstance(a, numba_types.Array) and a.layout == "C" for a in arrays):
        return None
    if panels.dtype not in (numba_types.float32, numba_types.int8) or not all(
            a.dtype == numba_types.float32 for a in arrays[1:]):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        panels_a, x_a, scale_a, out_a = (context.make_array(t)(context, builder, a)
                                         for t, a in zip(sig.args[:4], args[:4]))
        panel_i, row_i, rows_i, ahead_i = args[4:]
        depth = cgutils.unpack_tuple(builder, panels_a.shape)[1]
        stride = cgutils.unpack_tuple(builder, x_a.shape)[1]
        width = cgutils.unpack_tuple(builder, out_a.shape)[1]
        panel_size = builder.mul(depth, i64(PANEL))
        panel_at = builder.gep(panels_a.data, [builder.mul(panel_i, panel_size)])
        ahead_at = builder.gep(panels_a.data, [builder.mul(ahead_i, panel_size)])
        x_at = builder.gep(x_a.data, [builder.mul(row_i, stride)])
        first_channel = builder.mul(panel_i, i64(PANEL))
        out_at = builder.gep(out_a.data, [builder.add(builder.mul(row_i, width), first_channel)])
        scale_at = builder.gep(scale_a.data, [first_channel])
        scales = [builder.load(vector_at(builder, scale_at, i64(j * VECTOR)), align=4)
                  for j in range(PANEL_VECTORS)]
        multiply_add = fma(builder)
        element = sig.args[0].dtype
        step_bytes = PANEL * (1 if element == numba_types.int8 else 4)

        def step(lanes: list[list[list[ir.Value]]], k: ir.Value, fetch: bool) -> None:
            """One step over the input dimension at `k` into `lanes[r]` of each row r."""
            at = builder.mul(k, i64(PANEL))
            if fetch:
                prefetch(builder, builder.gep(ahead_at, [at]), locality=2)
            weights = _weights(builder, builder.gep(panel_at, [at]), element)
            for r, row_sums in enumerate(lanes):
                activation = builder.load(builder.gep(x_at, [builder.add(
                    builder.mul(i64(r), stride), k)]))
                spread = broadcast(builder, activation)
                for s, weight in zip(row_sums, weights):
                    builder.store(builder.call(multiply_add, [spread, weight, builder.load(s)]), s)

        def height(n: int) -> None:
            """A tile of n rows: its sums, the loop over the input dimension, the stores."""
            unroll = _lanes(n)
            fetches = n >= _FETCH_ROWS
            # sums[u][r][j]: lane u's sums of row r, vector j of the panel
            sums = [[[cgutils.alloca_once(builder, VEC) for _ in range(PANEL_VECTORS)]
                     for _ in range(n)] for _ in range(unroll)]
            for lane in sums:
                for row_sums in lane:
                    for s in row_sums:
                        builder.store(zeros(), s)
            whole = builder.mul(builder.sdiv(depth, i64(unroll)), i64(unroll))
            with cgutils.for_range_slice(builder, i64(0), whole, i64(unroll)) as (k, _):
                for u, lane in enumerate(sums):
                    step(lane, builder.add(k, i64(u)),
                         fetch=fetches and u * step_bytes % _LINE == 0)
            with cgutils.for_range_slice(builder, whole, depth, i64(1)) as (k, _):
                step(sums[0], k, fetch=fetches)
            for r in range(n):
                out_row = builder.mul(i64(r), width)
                for j in range(PANEL_VECTORS):
                    total = builder.load(sums[0][r][j])
                    for lane in sums[1:]:
                        total = builder.fadd(total, builder.load(lane[r][j]))
                    target = vector_at(builder, out_at, builder.add(out_row, i64(j * VECTOR)))
                    builder.store(builder.fmul(total, scales[j]), target, align=4)

        # one block of code per tile height, the loop over the input dimension in each
        by_count(builder, rows_i, TILE_ROWS, "tile_rows", height)
        return context.get_dummy_value()

    return numba_types.void(panels, x, scale, out, panel, row, rows, ahead), codegen


@numba.njit(inline="always")
def panel_rows(panels: np.ndarray, x: np.ndarray, scale: np.ndarray, out: np.ndarray,
               panel: int) -> None:
    """out[:, panel's channels] = (x . panel) * its scale for every row of x, `TILE_ROWS` at a
    time (inlined, numba IR, into the kernels that run panels: `by_panels` and the fused
    decode, each a panel per parallel task). x [rows, >= in]: rows `row_width(in)` floats long
    are read fastest."""
    rows = x.shape[0]
    ahead = min(panel + 1, panels.shape[0] - 1)
    row = 0
    while row < rows:
        _tile(panels, x, scale, out, panel, row, min(rows - row, TILE_ROWS), ahead)
        row += TILE_ROWS


def row_width(depth: int) -> int:
    """How many floats a row of a product's input takes in memory for `depth` values: whole
    cache lines, an odd number of them. A tile reads one value of each of its rows at a time;
    rows a multiple of two lines apart fall in a few of the L1 cache's sets and evict each other
    (1,536 floats, three 4 KiB pages for two rows, in two of 64 sets), which made the MLP's
    down product much slower on rows 1,536 floats long than on rows 1,552 long
    (docs/perf-log.md)."""
    lines = (depth + _LINE_FLOATS - 1) // _LINE_FLOATS
    return (lines | 1) * _LINE_FLOATS


def _by_panels(panels: np.ndarray, x: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """out [m, count * PANEL] = (x [m, >= in] . panels) * scale, a panel per parallel task."""
    for panel in numba.prange(panels.shape[0]):
        panel_rows(panels, x, scale, out, panel)


_panels = Twins(_by_panels)


def by_panels(x: torch.Tensor, weight: Panels) -> torch.Tensor:
    """x [rows, in] (any float dtype) . the packed weight -> [rows, out] in x's dtype."""
    floats = x.dtype == torch.float32
    rows, depth = x.shape
    width = row_width(depth) if rows >= _WAYS else depth
    if floats and width == depth:
        activations = x.contiguous().numpy()
    else:
        activations = np.empty((rows, width), np.float32)
        activations[:, :depth] = x.numpy() if floats else x.to(torch.float32).numpy()
    out = np.empty((x.shape[0], weight.scale.shape[0]), np.float32)
    _panels.run(weight.weights, activations, weight.scale, out)
    result = torch.from_numpy(out)
    if weight.channels != out.shape[1]:
        result = result[:, :weight.channels].contiguous()
    return result if floats else result.to(x.dtype)
