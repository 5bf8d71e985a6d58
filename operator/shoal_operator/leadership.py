"""This replica's side of the leader election (election.py) against the API: try every
RETRY_PERIOD_S; `leading` says whether it may reconcile now."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from kubernetes.client import ApiException

from shoal_operator.election import (
    RENEW_DEADLINE_S,
    RETRY_PERIOD_S,
    LeaseRecord,
    claim,
    released,
)
from shoal_operator.kube import CONFLICT, Kube

logger = logging.getLogger(__name__)
# one API call of the election gives up after this (a hung call would outlast any deadline)
CALL_TIMEOUT_S = RENEW_DEADLINE_S - RETRY_PERIOD_S


class Leadership:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self._valid_until = float("-inf")  # time.monotonic() up to which this replica leads
        self._led = False  # whether it led at the last try (to say when that lapsed)
        self._seen: LeaseRecord | None = None
        self._seen_since = datetime.now(UTC)

    @property
    def leading(self) -> bool:
        """Renewed within RENEW_DEADLINE_S: no other replica can have taken over yet."""
        return time.monotonic() < self._valid_until

    def try_once(self) -> None:
        """Read the Lease; renew it, take it over, or stand by (errors propagate; leadership
        then lapses at its deadline)."""
        started, now = time.monotonic(), datetime.now(UTC)
        if self._led and not self.leading:
            logger.warning("lease %s/%s not renewed for %ds: stopped leading", self.namespace,
                           self.name, RENEW_DEADLINE_S)
        self._led = self.leading
        body = self.kube.read_lease(self.namespace, self.name, CALL_TIMEOUT_S)
        current = LeaseRecord.from_spec(body.get("spec") or {}) if body else None
        if current != self._seen:
            self._seen, self._seen_since = current, now
        record = claim(current, self.identity, now, self._seen_since)
        if record is None:
            if self.leading:
                logger.warning("lease %s/%s is held by %s: standing by", self.namespace,
                               self.name, current and current.holder)
            self._valid_until, self._led = float("-inf"), False
            return
        version = body["metadata"]["resourceVersion"] if body else None
        try:
            self.kube.write_lease(self.namespace, self.name, record.to_spec(), version,
                                  CALL_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != CONFLICT:
                raise
            return  # another replica wrote first: read again next time
        if not self.leading:
            logger.info("leading as %s (lease %s/%s, transition %d)", self.identity,
                        self.namespace, self.name, record.transitions)
        self._valid_until = started + RENEW_DEADLINE_S
        self._led = True
        self._seen, self._seen_since = record, now

    def release(self) -> None:
        """Give the Lease up (on a clean stop), so a standby takes over at once."""
        if not self.leading:
            return
        self._valid_until = float("-inf")
        body = self.kube.read_lease(self.namespace, self.name, CALL_TIMEOUT_S)
        if body is None:
            return
        current = LeaseRecord.from_spec(body.get("spec") or {})
        if current.holder == self.identity:
            self.kube.write_lease(self.namespace, self.name, released(current).to_spec(),
                                  body["metadata"]["resourceVersion"], CALL_TIMEOUT_S)
