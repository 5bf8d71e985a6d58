"""Linear kernels chosen by measurement: the choice from timings, the stored layouts and int8
weights computing what `F.linear` computes, tied weights, the probe child, forward threads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import threadpoolctl
import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.threads import RankThreads, forward_threads
from shoal.kernels import kernel_probe, linear_kernels, panel_products
from shoal.kernels.kernel_probe import runs_in_child, runs_in_children
from shoal.kernels.linear_kernels import (
    FLOAT_KERNELS,
    INT8_KERNELS,
    LARGE_FORWARD_TOKENS,
    ROW_BUCKETS,
    TIMED_ROWS,
    Kernel,
    LinearKernel,
    bucket_index,
    choose,
    prepare_linears,
)
from shoal.kernels.panel_products import Panels
from shoal.kernels.quantization import quantize_per_channel
from shoal.models.layers import Linear


class _Weighted(Linear):
    def __init__(self, out: int, inp: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, inp), requires_grad=False)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = _Weighted(300, 48)
        self.proj = _Weighted(96, 48)
        self.head = _Weighted(300, 48)
        self.head.weight = self.embed.weight
        self.norm = nn.Parameter(torch.randn(48), requires_grad=False)

    def linears(self) -> list[Linear]:
        return [self.embed, self.proj, self.head]


@pytest.fixture
def model() -> _Tied:
    torch.manual_seed(0)
    return _Tied()


def _kernels(*specs: tuple[str, str]) -> tuple[Kernel, ...]:
    return tuple(Kernel(name, layout, lambda x, w: x) for name, layout in specs)


def test_choice_keeps_the_layout_that_loses_least_and_the_best_kernel_per_bucket() -> None:
    kernels = _kernels(("a-row", "row"), ("a-col", "col"), ("b-col", "col"))
    # col is 2x faster at one row and 10% slower at the others: the layout that loses least
    seconds = {("a-row", 0): 2.0, ("a-col", 0): 1.0, ("b-col", 0): 1.5}
    for b in range(1, len(ROW_BUCKETS)):
        seconds |= {("a-row", b): 1.0, ("a-col", b): 1.2, ("b-col", b): 1.1}
    choice = choose(seconds, kernels)
    assert choice.layout == "col"
    assert choice.kernels == ("a-col",) + ("b-col",) * (len(ROW_BUCKETS) - 1)


def test_choice_skips_untimed_kernels_and_fails_without_any() -> None:
    kernels = _kernels(("fast-but-broken", "row"), ("slow", "col"))
    seconds = {("slow", b): 1.0 for b in range(len(ROW_BUCKETS))} | {("fast-but-broken", 0): 0.1}
    assert choose(seconds, kernels).kernels == ("slow",) * len(ROW_BUCKETS)
    with pytest.raises(RuntimeError):
        choose({}, kernels)


def test_a_kernel_timed_in_some_buckets_is_chosen_there_and_others_elsewhere() -> None:
    kernels = _kernels(("mkl-col", "col"), ("one-thread-col", "col"), ("mkl-row", "row"))
    seconds = {(name, b): 1.0 for name in ("mkl-col", "mkl-row") for b in range(len(ROW_BUCKETS))}
    seconds |= {("one-thread-col", b): 0.5 for b in range(len(ROW_BUCKETS) - 1)}
    choice = choose(seconds, kernels)
    assert choice.layout == "col"
    assert choice.kernels == ("one-thread-col",) * (len(ROW_BUCKETS) - 1) + ("mkl-col",)


@pytest.mark.parametrize("threads, one_thread_buckets", [
    ((1, 2), {0, 1}), ((2, 2), set()), ((1, 1), set(range(4)))])
def test_a_one_thread_kernel_is_timed_only_where_products_run_on_one_thread(
        threads: tuple[int, int], one_thread_buckets: set[int]) -> None:
    kernels = (Kernel("any", "row", lambda x, w: F.linear(x, w.weight)),
               Kernel("single", "row", lambda x, w: F.linear(x, w.weight), one_thread=True))
    seconds = linear_kernels.measure(kernels, 24, 16, linear_kernels.bucket_threads(threads))
    assert {b for name, b in seconds if name == "single"} == one_thread_buckets
    assert {b for name, b in seconds if name == "any"} == set(range(len(ROW_BUCKETS)))


def test_a_kernel_is_timed_only_in_its_buckets_and_a_far_slower_one_no_further() -> None:
    calls: dict[str, int] = {"slow": 0}

    def slow(x: torch.Tensor, w: linear_kernels.StoredWeight) -> torch.Tensor:
        calls["slow"] += 1
        time.sleep(0.01)
        return F.linear(x, w.weight)

    kernels = (Kernel("any", "row", lambda x, w: F.linear(x, w.weight)),
               Kernel("middle", "row", lambda x, w: F.linear(x, w.weight), buckets=(1, 2)),
               Kernel("slow", "row", slow))
    seconds = linear_kernels.measure(kernels, 24, 16, (1,) * len(ROW_BUCKETS))
    assert {b for name, b in seconds if name == "middle"} == {1, 2}
    assert {b for name, b in seconds if name == "slow"} == set(range(len(ROW_BUCKETS)))
    # the untimed and the single product at each timed row count only
    assert calls["slow"] == 2 * sum(len(counts) for counts in TIMED_ROWS)
    assert all(seconds["slow", b] > 3 * seconds["any", b] for b in range(len(ROW_BUCKETS)))


@pytest.mark.parametrize("rows, bucket", [(1, 0), (2, 1), (11, 1), (12, 2), (255, 2),
                                          (ROW_BUCKETS[-1], 3), (4096, 3)])
def test_bucket_of_a_row_count(rows: int, bucket: int) -> None:
    assert bucket_index(rows) == bucket


def test_float_weights_keep_values_shapes_and_ties(model: _Tied) -> None:
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    choices = prepare_linears(model.linears(), "none", threads=(1, 1))
    assert set(choices) == {(300, 48), (96, 48)}
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.head.weight is model.embed.weight
    assert model.head.linear_kernel is model.embed.linear_kernel
    layout = choices[96, 48].layout
    assert model.proj.weight.stride() == ((1, 96) if layout == "col" else (48, 1))
    ids = torch.tensor([0, 7, 299])
    assert model.embed.linear_kernel is not None
    assert torch.equal(model.embed.linear_kernel.rows(ids), before["embed.weight"][ids])


@pytest.mark.parametrize("kernel", FLOAT_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 40, ROW_BUCKETS[-1]])
def test_every_float_kernel_matches_f_linear(kernel: Kernel, rows: int) -> None:
    weight = torch.randn(96, 48)
    stored = linear_kernels.StoredWeight(weight.t().contiguous().t() if kernel.layout == "col"
                                         else weight)
    product = LinearKernel(stored, [kernel] * len(ROW_BUCKETS))
    x = torch.randn(48, rows).t()  # a non-contiguous input too
    torch.testing.assert_close(product(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [k for k in (*FLOAT_KERNELS, *INT8_KERNELS) if k.copy],
                         ids=lambda k: k.name)
def test_a_packed_kernel_packs_its_weight_at_load_and_counts_the_copy(kernel: Kernel) -> None:
    weight = torch.randn(96, 48)
    stored = (linear_kernels.StoredWeight.int8(*quantize_per_channel(weight))
              if kernel.layout == "int8" else linear_kernels.StoredWeight(weight))
    plain = next(k for k in (*FLOAT_KERNELS, *INT8_KERNELS)
                 if k.layout == kernel.layout and k.copy is None)
    product = LinearKernel(stored, [plain, plain, kernel, kernel])
    assert product.packed_bytes >= 96 * 48 * stored.weight.element_size()
    assert product.packed_bytes == stored.packed_bytes
    assert LinearKernel(linear_kernels.StoredWeight(torch.randn(96, 48)),
                        [plain] * len(ROW_BUCKETS)).packed_bytes == 0


@pytest.mark.parametrize("channels", [16, 40, 96])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 13, 24, 25, 300])
@pytest.mark.parametrize("depth", [40, 43, 48])
def test_panels_compute_every_row_and_channel_of_any_shape(channels: int, rows: int,
                                                           depth: int) -> None:
    """Tiles of one to `TILE_ROWS` rows (six with AVX2, 24 with AVX-512: this host's build),
    panels of sixteen channels (the last one padded); a few-row tile's lanes over an input
    dimension they divide, and over one that leaves steps to the first lane; inputs of eight rows
    or more copied into rows of whole cache lines (40, 43), and read where they lie when fewer
    or already 48 floats (three lines)."""
    weight = torch.randn(channels, depth)
    x = torch.randn(rows, depth)
    got = panel_products.by_panels(x, Panels.of(weight.numpy()))
    assert got.shape == (rows, channels) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    q, scale = quantize_per_channel(weight)
    torch.testing.assert_close(panel_products.by_panels(x, Panels.of(q.numpy(), scale.numpy())),
                               F.linear(x, q.float() * scale[:, None]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("depth", "width"), [(1, 16), (40, 48), (48, 48), (64, 80),
                                              (576, 592), (1536, 1552)])
def test_a_product_input_row_is_an_odd_number_of_cache_lines(depth: int, width: int) -> None:
    assert panel_products.row_width(depth) == width


_AVX2_BUILD = """
import torch, torch.nn.functional as F
from shoal.kernels import decode_attention
from shoal.kernels import fused_decode, panel_products
from shoal.kernels.panel_products import Panels
assert (panel_products.VECTOR, panel_products.TILE_ROWS) == (8, 6)
weight = torch.randn(40, 43)
for rows in (1, 2, 5, 6, 13):
    x = torch.randn(rows, 43)
    torch.testing.assert_close(panel_products.by_panels(x, Panels.of(weight.numpy())),
                               F.linear(x, weight), rtol=1e-5, atol=1e-5)
assert fused_decode._agrees(False) and fused_decode._agrees(True)
assert decode_attention._agrees()
"""


def test_the_avx2_tile_computes_on_any_host() -> None:
    """numba told the target is an AVX2 CPU builds the six-row tile of two vectors (what an
    AVX-512 host, where this suite may run, would not build), and it computes the products, the
    fused layer and decode attention."""
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma"}
    done = subprocess.run([sys.executable, "-c", _AVX2_BUILD], check=False, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("kernel", INT8_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 5, ROW_BUCKETS[-1]])
def test_every_int8_kernel_is_close_to_the_float_product(kernel: Kernel, rows: int) -> None:
    weight = torch.randn(96, 48)
    q, scale = quantize_per_channel(weight)
    product = LinearKernel(linear_kernels.StoredWeight.int8(q, scale),
                           [kernel] * len(ROW_BUCKETS))
    x = torch.randn(rows, 48)
    expected = F.linear(x, weight)
    error = (product(x) - expected).norm() / expected.norm()
    assert error < 0.02, f"{kernel.name}: relative error {error:.4f}"


def test_w8a16_stores_int8_weights_and_keeps_products_and_lookups_close(model: _Tied) -> None:
    x = torch.randn(5, 48)
    expected = F.linear(x, model.proj.weight)
    expected_rows = model.embed.weight[[3, 299]].clone()
    prepare_linears(model.linears(), "w8a16", threads=(1, 1))
    assert model.proj.weight.dtype == torch.int8 and model.embed.weight.dtype == torch.int8
    assert model.head.weight is model.embed.weight
    assert model.norm.dtype == torch.float32
    got = model.proj.product(x)
    assert (got - expected).norm() / expected.norm() < 0.02
    assert model.embed.linear_kernel is not None
    rows = model.embed.linear_kernel.rows(torch.tensor([3, 299]))
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, expected_rows, rtol=0, atol=float(
        expected_rows.abs().max()) / 127)


def test_unprepared_layers_use_f_linear(model: _Tied) -> None:
    x = torch.randn(2, 48)
    assert torch.equal(model.proj.product(x), F.linear(x, model.proj.weight))


def test_torch_only_leaves_float_weights_to_f_linear_and_dequantizes_int8(model: _Tied) -> None:
    """`--cpu-kernels torch`: nothing measured, no weight moved; w8a16 weights run F.linear on
    their dequantized values."""
    weight = model.proj.weight
    assert prepare_linears(model.linears(), "none", torch_only=True) == {}
    assert model.proj.weight is weight and model.proj.linear_kernel is None
    x = torch.randn(3, 48)
    q, scale = quantize_per_channel(weight)
    prepare_linears(model.linears(), "w8a16", torch_only=True)
    assert model.proj.weight.dtype == torch.int8
    kernel = model.proj.linear_kernel
    assert isinstance(kernel, LinearKernel)
    assert {k.name for k in kernel.kernels} == {"dequantized"}
    torch.testing.assert_close(model.proj.product(x), F.linear(x, q.float() * scale[:, None]))


def test_probe_child_reports_a_trapped_instruction_a_failure_and_success() -> None:
    assert runs_in_child("fine", lambda: None)
    assert not runs_in_child("raises", lambda: 1 / 0)  # type: ignore[func-returns-value]
    assert not runs_in_child("sigill", lambda: os.kill(os.getpid(), signal.SIGILL))
    assert runs_in_child("the parent is unharmed", lambda: None)


def test_probe_children_run_at_once_each_with_its_own_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_probe, "PROBE_TIMEOUT_S", 3.0)
    start = time.monotonic()
    results = runs_in_children({
        "fine": lambda: None, "raises": lambda: 1 / 0,  # type: ignore[dict-item]
        "sigill": lambda: os.kill(os.getpid(), signal.SIGILL),
        "slow but in time": lambda: time.sleep(1.0), "also slow": lambda: time.sleep(1.0),
        "hangs": lambda: time.sleep(60)})
    assert results == {"fine": True, "raises": False, "sigill": False, "slow but in time": True,
                       "also slow": True, "hangs": False}
    assert time.monotonic() - start < 5.0  # together: not the sum of their times


def test_large_forwards_run_on_more_threads_and_restore_the_count() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    threads = RankThreads(base=1, large_forward=2)
    try:
        with forward_threads(threads, LARGE_FORWARD_TOKENS):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with forward_threads(threads, LARGE_FORWARD_TOKENS - 1):
            assert torch.get_num_threads() == 1
        with forward_threads(None, LARGE_FORWARD_TOKENS):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)


def test_numpy_blas_runs_on_one_thread_once_kernels_are_chosen(model: _Tied) -> None:
    """Its idle workers would spin beside torch's OpenMP threads (linear_kernels' docstring)."""
    prepare_linears(model.linears(), "none", threads=(2, 2))
    blas = [lib for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    assert blas and all(lib["num_threads"] == 1 for lib in blas)
