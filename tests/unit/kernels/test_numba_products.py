"""shoal's numba products compute what a float32 product of the dequantized int8 weight (or of a
float32 weight) computes, on every row count, odd channel count and depth, serially and in
parallel, and leave a forked child able to run them after the parallel kernel ran here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import numba_products
from shoal.kernels.kernel_probe import runs_in_child
from shoal.kernels.quantization import dequantize, quantize_per_channel

PRODUCTS = {"by_rows": numba_products.by_rows, "by_pairs": numba_products.by_pairs,
            "by_quads": numba_products.by_quads}


def _case(rows: int, channels: int, depth: int, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_per_channel(torch.randn(channels, depth, generator=gen))
    x = torch.randn(rows, depth, generator=gen)
    return x, q, scale, F.linear(x, dequantize(q, scale))


@pytest.mark.parametrize("name", PRODUCTS)
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 33])
@pytest.mark.parametrize("channels,depth", [(97, 45), (64, 576), (7, 1)])
def test_products_match_the_dequantized_float_product(
        name: str, count: int, rows: int, channels: int, depth: int, threads: int) -> None:
    torch.set_num_threads(count)
    x, q, scale, expected = _case(rows, channels, depth)
    got = PRODUCTS[name](x, q.numpy(), scale.numpy())
    assert got.shape == (rows, channels) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", PRODUCTS)
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 33])
def test_float32_weights_with_a_scale_of_ones_match_f_linear(
        name: str, count: int, rows: int, threads: int) -> None:
    torch.set_num_threads(count)
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(97, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    got = PRODUCTS[name](x, weight.numpy(), np.ones(97, np.float32))
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", PRODUCTS)
def test_other_activation_dtypes_come_back_in_their_dtype(name: str) -> None:
    x, q, scale, expected = _case(3, 40, 64)
    got = PRODUCTS[name](x.to(torch.bfloat16), q.numpy(), scale.numpy())
    assert got.dtype == torch.bfloat16
    assert float((got.float() - expected).norm() / expected.norm()) < 0.02


def test_a_child_forked_after_the_parallel_kernel_ran_runs_them(threads: int) -> None:
    torch.set_num_threads(2)
    x, q, scale, expected = _case(6, 50, 30)

    def run_all() -> None:
        for product in PRODUCTS.values():
            torch.testing.assert_close(product(x, q.numpy(), scale.numpy()), expected,
                                       rtol=1e-4, atol=1e-4)

    run_all()
    assert runs_in_child("int8-products", run_all)
