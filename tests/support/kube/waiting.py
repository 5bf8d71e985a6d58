"""Waiting for a condition in tests against the cluster."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.2,
               message: str = "") -> T:
    """Call `predicate` until it returns something truthy and return that; after `timeout`
    seconds raise AssertionError with `message` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message or 'condition not met'} after {timeout:g} s "
                                 f"(last value: {value!r})")
        time.sleep(interval)
