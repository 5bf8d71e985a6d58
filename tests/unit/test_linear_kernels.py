"""The CPU weight layout and the linear kernels behind it compute what `F.linear` computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.models import linear_kernels
from shoal.models.linear_kernels import linear, use_fast_layout


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 48)
        self.proj = nn.Linear(48, 96, bias=True)
        self.head = nn.Linear(48, 300, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.Parameter(torch.randn(48))


@pytest.fixture
def model() -> _Tied:
    torch.manual_seed(0)
    return _Tied().requires_grad_(False)


def test_layout_keeps_values_shapes_and_ties(model: _Tied) -> None:
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    use_fast_layout(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.head.weight is model.embed.weight
    assert model.proj.weight.stride() == (1, 96)  # column-major [out=96, in=48]
    assert model.norm.stride() == (1,)
    ids = torch.tensor([0, 7, 299])
    assert torch.equal(F.embedding(ids, model.embed.weight), before["embed.weight"][ids])


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_linear_matches_f_linear(model: _Tied, rows: int) -> None:
    x = torch.randn(rows, 48)
    expected = F.linear(x, model.proj.weight, model.proj.bias)
    expected_head = F.linear(x, model.head.weight)
    use_fast_layout(model)
    torch.testing.assert_close(linear(x, model.proj.weight, model.proj.bias), expected,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, model.head.weight), expected_head, rtol=1e-5, atol=1e-5)


def test_linear_takes_a_non_contiguous_input(model: _Tied) -> None:
    use_fast_layout(model)
    x = torch.randn(48, 5).t()
    torch.testing.assert_close(linear(x, model.proj.weight, model.proj.bias),
                               F.linear(x.contiguous(), model.proj.weight, model.proj.bias),
                               rtol=1e-5, atol=1e-5)


def test_large_products_run_on_more_threads_and_restore_the_count(
        model: _Tied, monkeypatch: pytest.MonkeyPatch) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    seen: list[int] = []
    real = linear_kernels._onednn_linear
    monkeypatch.setattr(linear_kernels, "_onednn_linear",
                        lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    try:
        use_fast_layout(model)
        x = torch.randn(linear_kernels.LARGE_PRODUCT_ROWS, 48)
        linear(x, model.proj.weight, model.proj.bias)  # outside the scope: the base count
        with linear_kernels.large_product_threads(base=1, large=2):
            for rows in (linear_kernels.LARGE_PRODUCT_ROWS, 8):
                x = torch.randn(rows, 48)
                torch.testing.assert_close(linear(x, model.proj.weight, model.proj.bias),
                                           F.linear(x, model.proj.weight, model.proj.bias),
                                           rtol=1e-5, atol=1e-5)
                assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
    assert seen == [1, 2, 1]
