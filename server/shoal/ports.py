"""Picking a free TCP port on 127.0.0.1 that nothing else will take before it is bound.

A port handed out by the kernel for `bind(("127.0.0.1", 0))` comes from the ephemeral range,
the same range every outgoing connection (gloo's pair sockets, the TCPStore clients, HTTP
clients) draws its local port from; between choosing such a port and a server binding it,
another process can take it. Ports are therefore drawn below (or above) the ephemeral range,
where the kernel never assigns one by itself.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
_ATTEMPTS = 200


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _candidates() -> range:
    low, high = ephemeral_range()
    below = range(_LOWEST, low)
    above = range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now and outside the kernel's ephemeral range."""
    candidates = _candidates()
    for port in random.sample(candidates, min(_ATTEMPTS, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in {candidates.start}-{candidates.stop - 1}")
