"""Pod IPs: one loopback address per pod, from a 127.N.0.0/16 of this kubelet's own.

Every pod shares the host's network namespace; its servers bind its own address, so pods can
use the same ports. A kubelet claims its N with a file (/tmp/shoal-kube-networks/N holding its
pid) and takes only an N no socket on this machine is bound in, so the clusters of parallel test
sessions never share an address. A freed pod IP is handed out again only after all the others,
as a real IPAM would rarely reuse one at once.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import psutil

SECOND_OCTETS = range(64, 255)
CLAIMS = Path(tempfile.gettempdir()) / "shoal-kube-networks"


def used_loopback_networks() -> set[int]:
    """Second octets of the 127.x addresses that sockets on this machine are bound to."""
    return {int(c.laddr.ip.split(".")[1]) for c in psutil.net_connections("inet4")
            if c.laddr and c.laddr.ip.startswith("127.")}


def _claim(octet: int) -> bool:
    """Take 127.<octet>/16 for this process unless a live process holds it."""
    claim = CLAIMS / str(octet)
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        with contextlib.suppress(OSError, ValueError):
            if psutil.pid_exists(int(claim.read_text())):
                return False
        claim.unlink(missing_ok=True)  # its kubelet is gone
        return _claim(octet)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


@contextlib.contextmanager
def claimed_network() -> Iterator[int]:
    """The second octet of a 127.N.0.0/16 this process holds until the block ends."""
    CLAIMS.mkdir(exist_ok=True)
    free = sorted(set(SECOND_OCTETS) - used_loopback_networks())
    random.shuffle(free)
    octet = next((n for n in free if _claim(n)), None)
    if octet is None:
        raise RuntimeError("no 127.N.0.0/16 (N in 64-254) is free of sockets and claims")
    try:
        yield octet
    finally:
        (CLAIMS / str(octet)).unlink(missing_ok=True)


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
