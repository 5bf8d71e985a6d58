"""The layer kernels compute what the torch ops they replace compute (RMSNorm with and without
the residual add, the rotary embedding in place), on every row count, serially and in parallel;
`prepare` switches a model to them only for CPU float32 activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import layer_kernels
from shoal.kernels.rotary import apply_rotary
from shoal.model_config import RopeConfig
from shoal.models.layers import RMSNorm
from shoal.models.rotary import Rotary


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norms_match_torch(count: int, rows: int, threads: int) -> None:
    torch.set_num_threads(count)
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    summed = x + residual
    normed, got_summed = layer_kernels.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(got_summed, summed, rtol=0, atol=0)
    torch.testing.assert_close(normed, F.rms_norm(summed, (576,), weight, 1e-5))
    torch.testing.assert_close(layer_kernels.rms_norm(x, weight, 1e-5),
                               F.rms_norm(x, (576,), weight, 1e-5))


def test_rms_norm_reads_a_strided_input() -> None:
    x = torch.randn(8, 2, 64)[:, 1]
    weight = torch.randn(64)
    torch.testing.assert_close(layer_kernels.rms_norm(x, weight, 1e-6),
                               F.rms_norm(x, (64,), weight, 1e-6))


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rotation_in_place_matches_apply_rotary(count: int, rows: int, threads: int) -> None:
    torch.set_num_threads(count)
    gen = torch.Generator().manual_seed(rows)
    rotary = Rotary(64, RopeConfig(theta=10000.0))
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (rows,), generator=gen), torch.float32)
    heads = torch.randn(rows, 9 + 3 + 3, 64, generator=gen)
    expected = heads.clone()
    expected[:, :12] = apply_rotary(heads[:, :12], cos, sin)
    layer_kernels.rotate_(heads, 12, cos, sin)
    torch.testing.assert_close(heads, expected)
    assert torch.equal(heads[:, 12:], expected[:, 12:])  # the value heads are left alone


def test_prepare_switches_cpu_float32_layers_only() -> None:
    norm = RMSNorm(8, 1e-6)
    assert layer_kernels.prepare([norm], torch.device("cpu"), torch.float32)
    assert norm.cpu_kernels
    assert not layer_kernels.prepare([norm], torch.device("cpu"), torch.bfloat16)
    assert not norm.cpu_kernels
    assert not layer_kernels.prepare([norm], torch.device("cuda"), torch.float32)
