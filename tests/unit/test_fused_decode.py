"""The fused decode layer computes what the layer computes op by op (torch's norm, products,
rotary embedding, SDPA over the paged K/V, SiLU), for float32 and int8 weights, serially and in
parallel; the engine takes it only where it can (CPU float32 activations, one tensor-parallel
rank). Row-major storage for it: test_linear_kernels.py. Whole models, fused against op by op
and against transformers: test_model_parity.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shoal.models import fused_decode


@pytest.fixture
def threads() -> Iterator[int]:
    previous = torch.get_num_threads()
    yield previous
    torch.set_num_threads(previous)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_layer_matches_the_ops(quantized: bool, count: int, threads: int) -> None:
    torch.set_num_threads(count)
    assert fused_decode._agrees(quantized)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_runs_on_this_host(quantized: bool) -> None:
    """The path the engine takes by default on CPU: a host where it cannot run would silently run
    op by op, so the CI host proves it runs (its serial build in a forked child first)."""
    assert fused_decode.usable(quantized)
    assert fused_decode.enabled_for(torch.device("cpu"), torch.float32, 1, quantized)


@pytest.mark.parametrize("device, dtype, tp_size", [
    ("cuda", torch.float32, 1), ("cpu", torch.bfloat16, 1), ("cpu", torch.float32, 2)])
def test_not_enabled_elsewhere(device: str, dtype: torch.dtype, tp_size: int) -> None:
    assert not fused_decode.enabled_for(torch.device(device), dtype, tp_size, False)


def test_reads_row_major_weights_only() -> None:
    weight = torch.randn(6, 4)
    assert fused_decode._Weight.of(weight, None).array.shape == (6, 4)
    with pytest.raises(ValueError, match="row-major"):
        fused_decode._Weight.of(weight.t().contiguous().t(), None)


