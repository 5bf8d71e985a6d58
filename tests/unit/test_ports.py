"""Ports handed to servers come from outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from shoal.ports import ephemeral_range, free_port


def test_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))

