"""A kernel's serial and parallel builds: cached under names of their own (numba's cache key
ignores the options, so one build would load the other's code), and run by torch's thread
count; the exp the kernels inline."""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from shoal.kernels.numba_kernels import Twins, exp_in_place


def _double(x: np.ndarray, out: np.ndarray) -> None:
    for i in numba.prange(x.shape[0]):
        out[i] = 2 * x[i]


def test_the_serial_and_parallel_builds_are_cached_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    twins = Twins(_double)
    x = np.arange(8, dtype=np.float32)
    for build in (twins.serial, twins.parallel):
        out = np.empty_like(x)
        build(x, out)
        np.testing.assert_array_equal(out, 2 * x)
    indexes = sorted(path.name.split("-")[0] for path in tmp_path.rglob("*.nbi"))
    assert indexes == ["test_numba_kernels._double_parallel", "test_numba_kernels._double_serial"]


def test_run_takes_the_serial_build_on_one_thread_and_the_parallel_on_more(threads: int) -> None:
    twins = Twins(_double)
    x = np.arange(5, dtype=np.float32)
    out = np.empty_like(x)
    torch.set_num_threads(1)
    twins.run(x, out)
    assert twins.serial.signatures and not twins.parallel.signatures
    torch.set_num_threads(2)
    twins.run(x, out)
    assert twins.parallel.signatures
    np.testing.assert_array_equal(out, 2 * x)


def test_exp_in_place() -> None:
    """The softmax's and SiLU's exp: within 1e-6 relative of the exact value from e^-87 to e^88,
    clamped beyond (a softmax's smallest terms and SiLU's largest negative inputs stay finite
    and vanish beside the others)."""
    x = np.concatenate([np.linspace(-87, 88, 20001), [-1000.0, -88.0, 0.0, 89.0, 1000.0]]
                       ).astype(np.float32)
    got = x.copy()
    exp_in_place(got, np.empty(len(x), np.int32))
    x = x.astype(np.float64)
    inside = (x >= -87) & (x <= 88)
    np.testing.assert_allclose(got[inside], np.exp(x[inside]), rtol=1e-6)
    low, high = np.exp(-87.0), np.exp(88.0)
    np.testing.assert_allclose(got[-5:], [low, low, 1.0, high, high], rtol=1e-6)
