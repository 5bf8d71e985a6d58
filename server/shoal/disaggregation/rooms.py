"""What both ends of a transfer keep per room, and what they count.

A room is one request's transfer, named by the number the router chose (`bootstrap_room`). Its
state only rises (BOOTSTRAPPING → WAITING → TRANSFERRING → SUCCESS), except that a failure
ends it anywhere before SUCCESS; a finished transfer is never failed after the fact.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from shoal.disaggregation.ranks import KVPoll


@dataclass
class Room:
    state: KVPoll = KVPoll.BOOTSTRAPPING
    deadline: float = math.inf  # while waiting on the peer: when waiting fails the room
    reason: str = ""            # why it failed

    def advance(self, state: KVPoll, deadline: float = math.inf) -> None:
        if self.state != KVPoll.FAILED and state > self.state:
            self.state, self.deadline = state, deadline

    def fail(self, reason: str) -> bool:
        """Fail the room unless it is over already; whether it was failed now."""
        if self.state in (KVPoll.FAILED, KVPoll.SUCCESS):
            return False
        self.state, self.reason = KVPoll.FAILED, reason
        return True

    def check_deadline(self, now: float, what: str) -> None:
        if now > self.deadline:
            self.fail(what)


class TransferCounters:
    """KV moved and transfers failed, on this rank; exported to /metrics (summed over the ranks
    of a node by the multiprocess collector) when metrics are on."""

    def __init__(self, export: bool) -> None:
        self.bytes_sent = self.bytes_received = self.tokens_sent = self.tokens_received = 0
        self.failures = 0
        self._lock = threading.Lock()
        self._bytes = self._tokens = self._failures = None
        if export:
            from prometheus_client import Counter

            self._bytes = Counter("shoal:kv_transfer_bytes", "KV cache bytes moved between "
                                  "prefill and decode servers", ["direction"])
            self._tokens = Counter("shoal:kv_transfer_tokens", "Prompt tokens whose KV was "
                                   "moved between prefill and decode servers", ["direction"])
            self._failures = Counter("shoal:kv_transfer_failures", "KV transfers that failed "
                                     "or were aborted")

    def sent(self, num_tokens: int, num_bytes: int) -> None:
        with self._lock:
            self.tokens_sent += num_tokens
            self.bytes_sent += num_bytes
        self._export("sent", num_tokens, num_bytes)

    def received(self, num_tokens: int, num_bytes: int) -> None:
        with self._lock:
            self.tokens_received += num_tokens
            self.bytes_received += num_bytes
        self._export("received", num_tokens, num_bytes)

    def failed(self) -> None:
        with self._lock:
            self.failures += 1
        if self._failures is not None:
            self._failures.inc()

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {"kv_bytes_sent": self.bytes_sent, "kv_bytes_received": self.bytes_received,
                    "kv_tokens_sent": self.tokens_sent,
                    "kv_tokens_received": self.tokens_received,
                    "kv_transfer_failures": self.failures}

    def _export(self, direction: str, num_tokens: int, num_bytes: int) -> None:
        if self._bytes is not None and self._tokens is not None:
            self._bytes.labels(direction).inc(num_bytes)
            self._tokens.labels(direction).inc(num_tokens)

