"""Pod IPs: one loopback address per pod, from a 127.N.0.0/16 no socket on this machine uses.

Every pod shares the host's network namespace; its servers bind its own address, so pods (and
clusters of parallel test sessions) can use the same ports. A freed address is handed out again
only after all the others, as a real IPAM would rarely reuse one at once.
"""

from __future__ import annotations

import ipaddress
import random
import threading
from collections import deque

import psutil

FIRST_OCTET_RANGE = range(64, 255)


def used_loopback_networks() -> set[int]:
    """Second octets of the 127.x addresses that sockets on this machine are bound to."""
    return {int(c.laddr.ip.split(".")[1]) for c in psutil.net_connections("inet4")
            if c.laddr and c.laddr.ip.startswith("127.")}


def pick_network() -> int:
    free = sorted(set(FIRST_OCTET_RANGE) - used_loopback_networks())
    if not free:
        raise RuntimeError("every 127.N.0.0/16 for N in 64-254 has a socket bound in it")
    return random.choice(free)


class PodAddresses:
    def __init__(self, second_octet: int) -> None:
        network = ipaddress.ip_network(f"127.{second_octet}.0.0/16")
        # .0.0 and .0.1 stay unused, as a network and gateway address would
        self._free = deque(str(ip) for ip in list(network.hosts())[1:])
        self._lock = threading.Lock()

    def allocate(self) -> str:
        with self._lock:
            return self._free.popleft()

    def release(self, ip: str) -> None:
        with self._lock:
            self._free.append(ip)
