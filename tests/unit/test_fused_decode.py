"""The fused decode layer computes what the layer computes op by op (torch's norm, products,
rotary embedding, SDPA over the paged K/V, SiLU), for float32 and int8 weights, serially and in
parallel; the engine takes it only where it can (CPU float32 activations, one tensor-parallel
rank). Its panels, packed for every weight: test_linear_kernels.py. Whole models, fused against
op by op and against transformers: test_model_parity.py."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from shoal.models import fused_decode
from shoal.models.panel_products import Panels


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


def test_refuses_a_hidden_size_that_is_not_whole_panels() -> None:
    """Its outputs are written a panel at a time into the layer's [rows, hidden] buffers."""
    def panels(out: int, inp: int) -> Panels:
        return Panels.of(torch.randn(out, inp).numpy())

    norm, none = np.ones(24, np.float32), np.zeros(0, np.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        fused_decode.FusedLayer(norm, panels(48, 24), none, panels(24, 16), none, norm,
                                panels(64, 24), panels(24, 32))
    assert fused_decode.FusedLayer(norm[:16], panels(48, 16), none, panels(16, 16), none,
                                   norm[:16], panels(64, 16), panels(16, 32))
