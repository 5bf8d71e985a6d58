"""Who leads (election.py): a new Lease, renewals, a take-over only after the holder's lease ran
out on the claimant's own clock or was given up, and the record written as the API stores it.
Two replicas against the real apiserver: tests/e2e/kube/operator/test_leader_election.py."""

from __future__ import annotations

from datetime import timedelta

from shoal_operator.election import (
    LEASE_DURATION_S,
    RENEW_DEADLINE_S,
    LeaseRecord,
    claim,
    released,
)
from tests.unit.operator.factories import T0

HELD = LeaseRecord("a", LEASE_DURATION_S, "2026-01-01T00:00:00.000000Z",
                   "2026-01-01T00:00:00.000000Z", 3)


def test_the_first_claimant_creates_the_lease() -> None:
    record = claim(None, "a", T0, T0)
    assert record == LeaseRecord("a", LEASE_DURATION_S, "2026-01-01T00:00:00.000000Z",
                                 "2026-01-01T00:00:00.000000Z", 0)
    assert record is not None and LeaseRecord.from_spec(record.to_spec()) == record


def test_the_holder_renews_and_keeps_its_acquire_time() -> None:
    later = T0 + timedelta(seconds=2)
    renewed = claim(HELD, "a", later, T0)
    assert renewed is not None
    assert (renewed.holder, renewed.acquired, renewed.transitions) == ("a", HELD.acquired, 3)
    assert renewed.renewed == "2026-01-01T00:00:02.000000Z"


def test_another_replica_waits_out_the_lease_on_its_own_clock() -> None:
    seen = T0 + timedelta(hours=5)  # its clock is far from the holder's: only seen_since counts
    assert claim(HELD, "b", seen, seen) is None
    assert claim(HELD, "b", seen + timedelta(seconds=LEASE_DURATION_S - 0.1), seen) is None
    taken = claim(HELD, "b", seen + timedelta(seconds=LEASE_DURATION_S), seen)
    assert taken is not None and (taken.holder, taken.transitions) == ("b", 4)


def test_a_released_lease_is_taken_at_once() -> None:
    given_up = released(HELD)
    assert given_up.holder == "" and given_up.duration_s == 1
    taken = claim(given_up, "b", T0, T0)
    assert taken is not None and (taken.holder, taken.transitions) == ("b", 4)


def test_a_leader_stops_before_anyone_may_take_over() -> None:
    assert RENEW_DEADLINE_S < LEASE_DURATION_S
