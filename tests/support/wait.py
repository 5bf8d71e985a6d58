"""One polling loop for every test that waits for something to become true."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str,
               interval: float = 0.1) -> T:
    """Poll `condition` until it returns something truthy, and return that; `TimeoutError`
    naming `what` and the last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout:g}s: {what} (last value: {result!r})")
        time.sleep(interval)
