"""Shared by the kernel tests: the torch thread count, restored after a test that sets it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def threads() -> Iterator[int]:
    previous = torch.get_num_threads()
    yield previous
    torch.set_num_threads(previous)
