"""The matrix products behind every linear layer: how each weight is stored and which kernel
computes its products, chosen by measuring the candidates on this host when the model loads.

No vendor guess holds on every CPU (docs/perf-log.md): which of MKL, oneDNN and numpy's OpenBLAS
is fastest, and in which weight layout, changes with the host and the row count. shoal's own numba
kernels (`shoal.kernels.numba_products`, on row-major weights) are candidates at a few rows, where
the libraries pack the weight for every product; oneDNN is also a candidate on a copy of the weight
packed once, at load, into its blocked layout (`onednn-packed`: a second copy of each weight it is
chosen for, logged at load), and shoal's panel kernel on its packed copy
(`shoal.kernels.panel_products`). So after loading, `prepare_linears` times every candidate (layout
x kernel) for each distinct weight shape at a few row counts (`ROW_BUCKETS`, each at the thread
count it will run with; the candidates in turns, best of three passes), keeps the layout that is
fastest over all of them, and per row bucket the fastest kernel in that layout; the choice is kept
on disk for later loads on the same host and software (`shoal.kernels.kernel_choices`). A kernel is
first run once in a forked child (`shoal.kernels.kernel_probe`): a VM may list an instruction set
and trap it.

Storage: float32 CPU weights go to one transparent-huge-page arena (faster streaming of every weight
once per decode step), row- or column-major (the logical [out, in] shape is kept, so sharding,
loading and the tied embedding lookup are unchanged). With `--quantization w8a16`
(`shoal.kernels.quantization`), each weight is int8 per output channel with a float32 scale; its
products are torch's `_weight_int8pack_mm` (fed bfloat16 activations, the input it is vectorized
for), numba kernels that widen the int8 weight in registers (`shoal.kernels.numba_products`), the
int8 panels, or a float32 product of the dequantized weight (prefill), whichever measures fastest in
each row bucket. Every float32 kernel differs from `F.linear` only in summation order. numpy's BLAS
runs on one thread (set by `prepare_linears`; idle workers would spin beside torch's OpenMP
threads), so its kernels are candidates only in the row buckets whose products run on one thread
(timed against multi-threaded MKL at a prefill's row count it looked as fast, and made a whole
prefill several times slower). With `torch_only` (`--cpu-kernels torch`) nothing is measured or
moved. Elsewhere (CUDA, other dtypes) weights stay row-major and `F.linear` runs; an int8 weight
runs `_weight_int8pack_mm`.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import threadpoolctl
import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import kernel_choices, numba_products, panel_products
from shoal.kernels.huge_pages import huge_page_arena
from shoal.kernels.interface import KernelLinear
from shoal.kernels.kernel_probe import runs_in_children
from shoal.kernels.panel_products import Panels
from shoal.kernels.quantization import dequantize, quantize_per_channel

logger = logging.getLogger(__name__)

# A product of m rows uses the choice of the bucket whose range holds m: 1 | 2-11 | 12-255 |
# 256+, each named by a row count of its range (ROW_BUCKETS) and timed at TIMED_ROWS, in
# seconds per row summed over them: 12-255 spans the decode batches from 16 to 64 streams, where
# the fastest kernel changes within the range (docs/perf-log.md). A forward of
# LARGE_FORWARD_TOKENS tokens or more runs on every core (`shoal.engine.threads`), so the last
# two buckets are timed there.
ROW_BUCKETS = (1, 4, 32, 256)
TIMED_ROWS = ((1,), (4,), (16, 32, 64), (256,))
_BUCKET_STARTS = (1, 2, 12, 256)
LARGE_FORWARD_TOKENS = _BUCKET_STARTS[2]
# Candidates are timed on random weights of the same shape and layout, at most this many output
# rows (the LM head's 49k rows behave like 16k: a copy larger than the last-level cache, as the
# head is; a copy that stays in cache times another kernel fastest than the whole head,
# docs/perf-log.md),
# and at small row counts on enough copies that a pass streams from memory as a decode step
# does, not from cache.
_MEASURE_MAX_OUT = 16384
_STREAM_BYTES = 48 << 20
_MAX_COPIES = 256
_MEMORY_BOUND_ROWS = 8
_REPEATS = 3
_GIVE_UP_RATIO = 3.0

# oneDNN blocks a packed weight for products of about this many rows (any count computes; 32
# ran 12-1024-row products within a few percent of the best blocking for each)
_PACKED_FOR_ROWS = 32


@dataclass
class StoredWeight:
    """A weight as the kernels read it: `weight` is the logical [out, in] tensor (float row- or
    column-major, or int8 row-major); an int8 weight has per-output-channel `scale`s (float32,
    and a bfloat16 copy for the kernel that takes bfloat16 activations)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    scale_bf16: torch.Tensor | None = None
    arrays: tuple[np.ndarray, np.ndarray] | None = None  # int8: weight and scale as numpy views
    packed: torch.Tensor | None = None  # see `pack`
    panels: Panels | None = None  # see `pack_panels`

    @classmethod
    def int8(cls, qweight: torch.Tensor, scale: torch.Tensor) -> StoredWeight:
        return cls(qweight, scale, scale.to(torch.bfloat16), (qweight.numpy(), scale.numpy()))

    @functools.cached_property
    def transposed(self) -> np.ndarray:
        """The float weight's [in, out] transpose as a numpy view (numpy's products)."""
        return self.weight.t().numpy()

    def pack(self) -> torch.Tensor:
        """The row-major float weight reordered into oneDNN's blocked layout: a copy, made on the
        first call (`LinearKernel` makes it at load for a kernel that reads it)."""
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _PACKED_FOR_ROWS)
        return self.packed

    def pack_panels(self) -> Panels:
        """The weight (float32, or int8 with its scale) packed into `panel_products`' panels: a
        copy, made on the first call (`LinearKernel` makes it at load for a kernel that reads
        it)."""
        if self.panels is None:
            self.panels = (Panels.of(*self.arrays) if self.arrays is not None
                           else Panels.of(self.weight.contiguous().numpy()))
        return self.panels

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies made of it (see `pack` and `pack_panels`)."""
        return ((0 if self.packed is None else self.weight.numel() * 4)
                + (0 if self.panels is None else self.panels.nbytes))

    @functools.cached_property
    def float_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """A row-major float weight as a numpy view, and a scale of ones (shoal's products)."""
        return self.weight.numpy(), np.ones(self.weight.shape[0], np.float32)


Product = Callable[[torch.Tensor, StoredWeight], torch.Tensor]


def _mkl(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return F.linear(x, w.weight)


def _onednn(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.weight, None, "none", [], "")


def _onednn_packed(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.pack(), None, "none", [], "")


def _panels(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return panel_products.by_panels(x, w.pack_panels())


def _numpy(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return torch.from_numpy(np.matmul(x.contiguous().numpy(), w.transposed))


def _int8pack_bf16(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    assert w.scale_bf16 is not None
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), w.weight, w.scale_bf16).to(x.dtype)


def _int8_by_rows(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    assert w.arrays is not None
    return numba_products.by_rows(x, *w.arrays)


def _int8_by_pairs(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    assert w.arrays is not None
    return numba_products.by_pairs(x, *w.arrays)


def _int8_by_quads(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    assert w.arrays is not None
    return numba_products.by_quads(x, *w.arrays)


def _float_by_pairs(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return numba_products.by_pairs(x, *w.float_arrays)


def _float_by_quads(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return numba_products.by_quads(x, *w.float_arrays)


def _dequantized(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    assert w.scale is not None
    return F.linear(x, w.weight.to(x.dtype)).mul_(w.scale.to(x.dtype))


@dataclass(frozen=True)
class Kernel:
    name: str
    layout: str  # "row" | "col" (float) or "int8"
    product: Product
    one_thread: bool = False  # runs on one thread whatever torch's count: timed only there
    # the packed copy of the weight it reads (`StoredWeight.pack` or `pack_panels`), made at load
    copy: Callable[[StoredWeight], object] | None = None
    buckets: tuple[int, ...] = tuple(range(len(ROW_BUCKETS)))  # where it is a candidate


# Row buckets where shoal's numba kernels are candidates: none of the dot-product ones in the
# prefill-sized bucket (MKL and oneDNN run it on every core), the four-channel-by-three-row
# blocking not at one row (a lone row takes its tail loop, measured ~3x slower in a decode step
# than its isolated timing).
_FEW_ROWS = (0, 1, 2)
_SEVERAL_ROWS = (1, 2)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_ONEDNN_PACKED = _ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
FLOAT_KERNELS = (Kernel("mkl-row", "row", _mkl), Kernel("mkl-col", "col", _mkl),
                 *([Kernel("onednn-row", "row", _onednn), Kernel("onednn-col", "col", _onednn)]
                   if _ONEDNN else []),
                 *([Kernel("onednn-packed", "row", _onednn_packed, copy=StoredWeight.pack)]
                   if _ONEDNN_PACKED else []),
                 Kernel("panels", "row", _panels, copy=StoredWeight.pack_panels),
                 Kernel("numpy-row", "row", _numpy, one_thread=True),
                 Kernel("numpy-col", "col", _numpy, one_thread=True),
                 Kernel("numba-pairs", "row", _float_by_pairs, buckets=_FEW_ROWS),
                 Kernel("numba-quads", "row", _float_by_quads, buckets=_SEVERAL_ROWS))
INT8_KERNELS = (Kernel("int8pack-bf16", "int8", _int8pack_bf16),
                Kernel("int8-rows", "int8", _int8_by_rows),
                Kernel("int8-pairs", "int8", _int8_by_pairs),
                Kernel("int8-quads", "int8", _int8_by_quads, buckets=_SEVERAL_ROWS),
                Kernel("int8-panels", "int8", _panels, copy=StoredWeight.pack_panels),
                Kernel("dequantized", "int8", _dequantized))
_DEQUANTIZED = INT8_KERNELS[-1]


def bucket_index(rows: int) -> int:
    """Which of `ROW_BUCKETS` a product of `rows` rows uses."""
    index = 0
    for i, start in enumerate(_BUCKET_STARTS):
        if rows >= start:
            index = i
    return index


class LinearKernel:
    """The products of one weight: its stored form and, per row bucket, the kernel chosen."""

    def __init__(self, stored: StoredWeight, kernels: list[Kernel]) -> None:
        assert len(kernels) == len(ROW_BUCKETS)
        self.stored = stored
        self.kernels = kernels
        self._products = [k.product for k in kernels]
        for kernel in kernels:
            if kernel.copy is not None:
                kernel.copy(stored)  # now, at load, not in the first batch of many rows

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies its kernels read besides the stored weight (0: none)."""
        return self.stored.packed_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] float, as `F.linear(x, weight)`."""
        return self._products[bucket_index(x.shape[0])](x, self.stored)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the logical weight, dequantized (the embedding lookup)."""
        rows = F.embedding(ids, self.stored.weight)
        if self.stored.scale is None:
            return rows
        return rows.float() * self.stored.scale[ids, None]


@dataclass(frozen=True)
class Choice:
    layout: str
    kernels: tuple[str, ...]  # one kernel name per row bucket


def choose(seconds: dict[tuple[str, int], float], kernels: tuple[Kernel, ...]) -> Choice:
    """From measured seconds per (kernel name, bucket index): the layout whose best kernels lose
    least to the best of all layouts, summed over buckets in log ratio, and per bucket the
    fastest kernel in that layout. A kernel without a time in a bucket (failed, not probed, or
    not a candidate there) is never chosen for it; a layout needs a timed kernel in every one."""
    buckets = range(len(ROW_BUCKETS))

    def timed(layout: str, bucket: int) -> list[Kernel]:
        return [k for k in kernels if k.layout == layout and (k.name, bucket) in seconds]

    layouts = sorted(layout for layout in {k.layout for k in kernels}
                     if all(timed(layout, b) for b in buckets))
    if not layouts:
        raise RuntimeError("no linear kernel ran on this host")
    best = [min(seconds[k.name, b] for layout in layouts for k in timed(layout, b))
            for b in buckets]

    def best_in(layout: str, bucket: int) -> Kernel:
        return min(timed(layout, bucket), key=lambda k: seconds[k.name, bucket])

    def loss(layout: str) -> float:
        return sum(math.log(seconds[best_in(layout, b).name, b] / best[b]) for b in buckets)

    layout = min(layouts, key=loss)
    return Choice(layout, tuple(best_in(layout, b).name for b in range(len(ROW_BUCKETS))))


# -- measuring ------------------------------------------------------------------------------


def _candidate_weights(kernel: Kernel, out: int, inp: int, copies: int) -> list[StoredWeight]:
    """`copies` copies of a random weight of shape [out, in] in `kernel`'s layout."""
    weight = torch.randn(out, inp)
    if kernel.layout == "int8":
        q, scale = quantize_per_channel(weight)
        return [StoredWeight.int8(q.clone(), scale) for _ in range(copies)]
    if kernel.layout == "col":
        weight = weight.t().contiguous()
        return [StoredWeight(weight.clone().t()) for _ in range(copies)]
    return [StoredWeight(weight.clone()) for _ in range(copies)]


def _single(kernel: Kernel, weight: StoredWeight, x: torch.Tensor) -> float:
    """Seconds of one product, after one untimed (a numba kernel compiles or loads its build
    then): from cache, an upper bound."""
    kernel.product(x, weight)
    start = time.perf_counter()
    kernel.product(x, weight)
    return time.perf_counter() - start


def _pass(kernel: Kernel, weights: list[StoredWeight], x: torch.Tensor) -> float:
    """Seconds per product over one pass through `weights`."""
    start = time.perf_counter()
    for w in weights:
        kernel.product(x, w)
    return (time.perf_counter() - start) / len(weights)


def bucket_threads(threads: tuple[int, int]) -> tuple[int, ...]:
    """The torch threads each row bucket's products run on, from (base, large forward)."""
    return tuple(threads[1] if start >= LARGE_FORWARD_TOKENS else threads[0]
                 for start in _BUCKET_STARTS)


def measure(kernels: tuple[Kernel, ...], out: int, inp: int, threads: tuple[int, ...]
            ) -> dict[tuple[str, int], float]:
    """Seconds per product row of each kernel at each of its row buckets for an [out, in]
    weight, summed over the bucket's `TIMED_ROWS`; bucket b at `threads[b]` torch threads
    (`bucket_threads`). A `one_thread` kernel is timed
    only in buckets that run on one thread. Each kernel's time is
    its best of `_REPEATS` passes, taken in turns (a noisy moment of the host falls on every
    kernel alike); a kernel whose single product is `_GIVE_UP_RATIO` times the fastest one's is
    far behind and timed no further."""
    out = min(out, _MEASURE_MAX_OUT)
    streamed = {k.name: _candidate_weights(k, out, inp, min(_MAX_COPIES, math.ceil(
        _STREAM_BYTES / (out * inp * (1 if k.layout == "int8" else 4))))) for k in kernels}
    previous = torch.get_num_threads()
    seconds: dict[tuple[str, int], float] = {}
    try:
        for b, counts in enumerate(TIMED_ROWS):
            count = threads[b]
            torch.set_num_threads(count)
            xs = [torch.randn(rows, inp) for rows in counts]
            timed = [k for k in kernels
                     if b in k.buckets and not (k.one_thread and count > 1)]
            best = {k.name: sum(_single(k, streamed[k.name][0], x) / len(x) for x in xs)
                    for k in timed}
            fastest = min(best.values(), default=math.inf)
            contenders = [k for k in timed if best[k.name] <= _GIVE_UP_RATIO * fastest]
            for _ in range(_REPEATS):
                for kernel in contenders:
                    weights = streamed[kernel.name]
                    best[kernel.name] = min(best[kernel.name], sum(_pass(
                        kernel, weights if len(x) <= _MEMORY_BOUND_ROWS else weights[:1], x
                    ) / len(x) for x in xs))
            seconds.update({(name, b): t for name, t in best.items()})
    finally:
        torch.set_num_threads(previous)
    return seconds


def _usable(kernels: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
    """The kernels that run (in children first: an instruction the VM traps kills only that)
    and compute `F.linear`'s result on a small product."""
    weight = torch.randn(24, 40)
    x = torch.randn(3, 40)
    runs = runs_in_children({k.name: functools.partial(_check, k, weight, x) for k in kernels})
    for kernel in kernels:
        if not runs[kernel.name]:
            logger.warning("linear kernel %s does not run on this host; not used", kernel.name)
    return tuple(k for k in kernels if runs[k.name])


def _check(kernel: Kernel, weight: torch.Tensor, x: torch.Tensor) -> None:
    if kernel.layout == "int8":
        q, scale = quantize_per_channel(weight)
        stored = StoredWeight.int8(q, scale)
        expected = F.linear(x, dequantize(q, scale))
        tolerance = 0.05  # bfloat16 activations
    else:
        stored = StoredWeight(weight.t().contiguous().t() if kernel.layout == "col" else weight)
        expected = F.linear(x, weight)
        tolerance = 1e-4
    error = float((kernel.product(x, stored) - expected).abs().max())
    if not error <= tolerance * float(expected.abs().max()):
        raise ArithmeticError(f"{kernel.name}: off by {error} on a small product")


# -- preparing a model ----------------------------------------------------------------------


def prepare_linears(linears: Sequence[KernelLinear], quantization: str,
                    threads: tuple[int, int] | None = None, *, torch_only: bool = False
                    ) -> dict[tuple[int, int], Choice]:
    """Give every layer in `linears` the kernel of its `weight`: quantized when `quantization`
    is "w8a16", laid out and computed as measured here for float32 CPU weights. Tied weights
    share one kernel. `threads`: (base, large forward) torch threads the products will run with
    (default: the current count). `torch_only`: torch's own products (float weights left as they
    are, their layers on `F.linear`; int8 weights dequantized into `F.linear`). Returns the
    choice per weight shape [out, in]."""
    params = list({id(m.weight): m.weight for m in linears}.values())
    quantize = quantization == "w8a16"
    if not params or (torch_only and not quantize):
        return {}
    measured = not torch_only and params[0].device.type == "cpu" and (
        quantize or params[0].dtype == torch.float32)
    if not measured:
        fallback = (_DEQUANTIZED if torch_only else INT8_KERNELS[0]) if quantize \
            else FLOAT_KERNELS[0]
        choices = {tuple(p.shape): Choice(fallback.layout, (fallback.name,) * len(ROW_BUCKETS))
                   for p in params}
    else:
        # numpy's BLAS (the `numpy-*` kernels) on one thread, for the life of the process
        threadpoolctl.threadpool_limits(1, user_api="blas")
        count = torch.get_num_threads()
        threads = threads or (count, count)
        choices = {shape: _measured_choice(quantize, shape, bucket_threads(threads))
                   for shape in sorted({tuple(p.shape) for p in params})}
    by_name = {k.name: k for k in (*FLOAT_KERNELS, *INT8_KERNELS)}
    stored = _store(params, {id(p): choices[tuple(p.shape)].layout for p in params}, quantize)
    linear_kernels = {id(p): LinearKernel(stored[id(p)], [by_name[name] for name in
                                                          choices[tuple(p.shape)].kernels])
                      for p in params}
    packed = sum(k.packed_bytes for k in linear_kernels.values())
    if packed:
        logger.info("packed copies of the weights (oneDNN's, panels): %.0f MiB", packed / 2**20)
    for linear in linears:
        linear.linear_kernel = linear_kernels[id(linear.weight)]
    return choices


@functools.cache
def _usable_kernels(quantize: bool) -> tuple[Kernel, ...]:
    return _usable(INT8_KERNELS if quantize else FLOAT_KERNELS)


@functools.cache
def int8_panels_run() -> bool:
    """Whether `panel_products.by_panels` on int8 panels runs here and computes `F.linear`'s
    result (checked once, in a child)."""
    return bool(_usable(tuple(k for k in INT8_KERNELS if k.name == "int8-panels")))


@functools.cache
def _measured_choice(quantize: bool, shape: tuple[int, int], threads: tuple[int, ...]
                     ) -> Choice:
    """Measured once on this host for each weight shape, thread counts and layouts, and kept
    (`shoal.kernels.kernel_choices`; a process that loads several models, as the tests do, asks
    once per shape)."""
    kernels = _usable_kernels(quantize)
    names = tuple(k.name for k in kernels)
    kept_as = kernel_choices.key(quantize, shape, threads, names, TIMED_ROWS)
    kept = _kept_choice(kernel_choices.load(kept_as), kernels)
    if kept is not None:
        choice, how = kept, "kept from an earlier load"
    else:
        choice, how = choose(measure(kernels, *shape, threads), kernels), "measured"
        kernel_choices.store(kept_as, (choice.layout, choice.kernels))
    logger.info("linear [%d, %d]: %s layout, kernels by rows %s (%s)", *shape, choice.layout,
                dict(zip(_BUCKET_STARTS, choice.kernels)), how)
    return choice


def _kept_choice(entry: kernel_choices.Entry | None, kernels: tuple[Kernel, ...]
                 ) -> Choice | None:
    """A kept choice, if it names a usable kernel of its layout for every row bucket."""
    if entry is None:
        return None
    layout, names = entry
    by_name = {k.name: k for k in kernels}
    if len(names) == len(ROW_BUCKETS) and all(
            name in by_name and by_name[name].layout == layout for name in names):
        return Choice(layout, names)
    return None


def _store(params: list[nn.Parameter], layouts: dict[int, str], quantize: bool
           ) -> dict[int, StoredWeight]:
    """Move each parameter into its stored form; the parameter keeps that tensor (int8 when
    quantized), so no float copy stays alive."""
    stored: dict[int, StoredWeight] = {}
    in_arena = {id(p): p for p in params if layouts[id(p)] in ("row", "col")
                and p.device.type == "cpu" and p.dtype == torch.float32}
    arena = huge_page_arena(sum(p.numel() for p in in_arena.values())) if in_arena else None
    offset = 0
    for param in params:
        if quantize:
            q, scale = quantize_per_channel(param.data.float())
            param.data = q
            stored[id(param)] = StoredWeight.int8(q, scale)
            continue
        if arena is not None and id(param) in in_arena:
            rows, cols = param.shape
            chunk = arena[offset:offset + param.numel()]
            offset += param.numel()
            if layouts[id(param)] == "col":
                chunk.view(cols, rows).copy_(param.data.t())
                param.data = chunk.view(cols, rows).t()
            else:
                chunk.view(rows, cols).copy_(param.data)
                param.data = chunk.view(rows, cols)
        stored[id(param)] = StoredWeight(param.data)
    return stored
