"""Which operator replica leads: one reconciles, the others stand by, decided through a
`coordination.k8s.io` Lease as controller-runtime's leader election does. Pure.

Each replica tries every RETRY_PERIOD_S. The holder renews its Lease; another replica takes it
over once it has seen the same record for LEASE_DURATION_S without a renewal (time measured on
its own clock from when it saw the record change, never by comparing clocks), or at once when
the holder gave it up. A holder that could not renew for RENEW_DEADLINE_S stops leading before
anyone may take over. Writes go against the resourceVersion read, so of two replicas that claim
the same Lease at once, one write fails.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

# a standby takes over at most LEASE_DURATION_S + 2 * RETRY_PERIOD_S after the leader's end
LEASE_DURATION_S = 8
RENEW_DEADLINE_S = 6
RETRY_PERIOD_S = 1


def format_micro_time(moment: datetime) -> str:
    """A Lease's MicroTime: RFC 3339 with microseconds."""
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseRecord:
    holder: str  # "" when nobody holds it
    duration_s: int
    acquired: str | None
    renewed: str | None
    transitions: int

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> LeaseRecord:
        return cls(holder=spec.get("holderIdentity") or "",
                   duration_s=int(spec.get("leaseDurationSeconds") or LEASE_DURATION_S),
                   acquired=spec.get("acquireTime"), renewed=spec.get("renewTime"),
                   transitions=int(spec.get("leaseTransitions") or 0))

    def to_spec(self) -> dict[str, Any]:
        return {"holderIdentity": self.holder, "leaseDurationSeconds": self.duration_s,
                "acquireTime": self.acquired, "renewTime": self.renewed,
                "leaseTransitions": self.transitions}


def claim(current: LeaseRecord | None, me: str, now: datetime,
          seen_since: datetime) -> LeaseRecord | None:
    """The record `me` writes to lead from `now` on: a new Lease, a renewal of its own, or a
    take-over of one not renewed since `seen_since` (when this replica first saw `current`) for
    its duration, or given up; None while another replica holds it."""
    stamp = format_micro_time(now)
    if current is None:
        return LeaseRecord(me, LEASE_DURATION_S, stamp, stamp, 0)
    if current.holder == me:
        return replace(current, duration_s=LEASE_DURATION_S, renewed=stamp)
    expired = now >= seen_since + timedelta(seconds=current.duration_s)
    if current.holder and not expired:
        return None
    return LeaseRecord(me, LEASE_DURATION_S, stamp, stamp, current.transitions + 1)


def released(current: LeaseRecord) -> LeaseRecord:
    """What a leader that stops writes: nobody holds it, so a standby takes it at once."""
    return replace(current, holder="", duration_s=1)
