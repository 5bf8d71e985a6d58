"""Linear kernel choices kept per host: stored and read back, keyed by everything they depend
on, ignored when malformed or naming a kernel that is not usable, and a later load skips
measuring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shoal.kernels import kernel_choices, linear_kernels
from shoal.kernels.linear_kernels import FLOAT_KERNELS, ROW_BUCKETS, prepare_linears
from shoal.models.layers import Linear

ROWS = ((1,), (4,))


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    linear_kernels._measured_choice.cache_clear()
    yield tmp_path
    linear_kernels._measured_choice.cache_clear()


def test_a_stored_choice_is_read_back(cache_dir: Path) -> None:
    name = kernel_choices.key(False, (96, 48), (1, 2), ("a", "b"), ROWS)
    assert kernel_choices.load(name) is None
    kernel_choices.store(name, ("col", ("a", "b", "b", "a")))
    other = kernel_choices.key(False, (48, 96), (1, 2), ("a", "b"), ROWS)
    kernel_choices.store(other, ("row", ("b",) * 4))
    assert kernel_choices.load(name) == ("col", ("a", "b", "b", "a"))
    assert kernel_choices.load(other) == ("row", ("b",) * 4)
    assert [p.name for p in cache_dir.iterdir()] == [kernel_choices.FILE_NAME]


def test_the_key_names_quantization_shape_threads_candidates_and_timed_rows() -> None:
    base = (False, (96, 48), (1, 2), ("a", "b"), ROWS)
    keys = {kernel_choices.key(*base), kernel_choices.key(True, *base[1:]),
            kernel_choices.key(False, (48, 96), *base[2:]),
            kernel_choices.key(False, (96, 48), (2, 2), ("a", "b"), ROWS),
            kernel_choices.key(False, (96, 48), (1, 2), ("a",), ROWS),
            kernel_choices.key(False, (96, 48), (1, 2), ("a", "b"), ((1,), (4, 8)))}
    assert len(keys) == 6
    assert kernel_choices.key(*base) == kernel_choices.key(*base)


def test_the_key_names_the_source_of_shoals_kernels(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A choice kept by one build of the kernels is not read back by another."""
    monkeypatch.syspath_prepend(str(tmp_path))
    kernel = tmp_path / "kernel_under_test.py"
    kernel.write_text("ROWS = 8\n")
    before = kernel_choices.sources_digest(("kernel_under_test",))
    kernel.write_text("ROWS = 16\n")
    assert kernel_choices.sources_digest(("kernel_under_test",)) != before
    assert "panel_products" in " ".join(kernel_choices.KERNEL_MODULES)
    kernel_choices._host.cache_clear()
    monkeypatch.setattr(kernel_choices, "KERNEL_MODULES", ("kernel_under_test",))
    newer = kernel_choices.key(False, (96, 48), (1, 2), ("a",), ROWS)
    kernel.write_text("ROWS = 8\n")
    kernel_choices._host.cache_clear()
    assert kernel_choices.key(False, (96, 48), (1, 2), ("a",), ROWS) != newer
    kernel_choices._host.cache_clear()


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"k": ["col", "x"]}',
                                  '{"k": [1, ["a"]]}'])
def test_a_malformed_file_or_entry_reads_as_none(cache_dir: Path, text: str) -> None:
    (cache_dir / kernel_choices.FILE_NAME).write_text(text)
    assert kernel_choices.load("k") is None


def test_an_unwritable_cache_keeps_nothing_and_raises_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(blocker / "cache"))
    kernel_choices.store("k", ("row", ("a",) * 4))
    assert kernel_choices.load("k") is None


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Linear()
        self.a.weight = nn.Parameter(torch.randn(40, 24), requires_grad=False)
        self.b = Linear()
        self.b.weight = nn.Parameter(torch.randn(24, 40), requires_grad=False)

    def linears(self) -> list[Linear]:
        return [self.a, self.b]


def test_a_later_load_takes_the_kept_choice_without_measuring(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = prepare_linears(_Two().linears(), "none", threads=(1, 1))
    linear_kernels._measured_choice.cache_clear()

    def no_measuring(*args: object) -> None:
        raise AssertionError("measured although a choice was kept")

    monkeypatch.setattr(linear_kernels, "measure", no_measuring)
    model = _Two()
    assert prepare_linears(model.linears(), "none", threads=(1, 1)) == first
    x = torch.randn(3, 24)
    torch.testing.assert_close(model.a.product(x), x @ model.a.weight.t(), rtol=1e-4, atol=1e-4)


def test_a_kept_choice_naming_an_unusable_kernel_is_measured_again(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = prepare_linears(_Two().linears(), "none", threads=(1, 1))
    entries = json.loads((cache_dir / kernel_choices.FILE_NAME).read_text())
    for name in entries:
        entries[name] = [entries[name][0], ["gone"] * len(ROW_BUCKETS)]
    (cache_dir / kernel_choices.FILE_NAME).write_text(json.dumps(entries))
    linear_kernels._measured_choice.cache_clear()
    measured: list[tuple[int, int]] = []
    real_measure = linear_kernels.measure

    def counting(kernels: tuple, out: int, inp: int, threads: tuple[int, int]) -> dict:
        measured.append((out, inp))
        return real_measure(kernels, out, inp, threads)

    monkeypatch.setattr(linear_kernels, "measure", counting)
    again = prepare_linears(_Two().linears(), "none", threads=(1, 1))
    assert sorted(measured) == sorted(first)
    assert {c.kernels[0] for c in again.values()} <= {k.name for k in FLOAT_KERNELS}
