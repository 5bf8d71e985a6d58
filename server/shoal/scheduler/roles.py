"""A server's disaggregation mode as an object the scheduler calls: the loops keep one shape
(normal and overlap), and a colocated server's role does nothing (docs/pd.md).

    hook                    called from                     prefill / decode role
    accept(req, bootstrap)  Scheduler._add_request          hold a new request in its queue
    abort(rid)              Scheduler._abort                drop it there; tell the peer
    before_schedule(state)  Scheduler.schedule, first       move requests on as their
                                                            transfers do (into `waiting` /
                                                            `running`, or out, aborted)
    after_step(batch, ...)  Scheduler.process_results,      prefill: send the KV each step
                            before outputs and releases     computed; hold first tokens
    wait(timeout)           Scheduler._on_idle              until a transfer moves on

Every hook runs on every rank in the same order with the same requests, and the prefill and
decode roles agree on each transfer's state over the ranks (`disaggregation.ranks.agree`), so
ranks make the same decisions.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from shoal.ipc.messages import BootstrapInfo
from shoal.models.forward_batch import ForwardBatch
from shoal.scheduler.admission import NewTokenRatio
from shoal.scheduler.request import Req


class SchedulerState(Protocol):
    """What a role reads and moves of the scheduler's state."""

    waiting: deque[Req]
    running: list[Req]
    new_token_ratio: NewTokenRatio


class StepBatch(Protocol):
    """What a role reads of a step's batch (`scheduler.ScheduledBatch`)."""

    entries: list[tuple[Req, int]]
    epochs: list[int]
    forward: ForwardBatch


class Role(Protocol):
    @property
    def has_work(self) -> bool:
        """Requests held outside `waiting` and `running` (queued for or in a transfer)."""

    def accept(self, req: Req, bootstrap: BootstrapInfo | None) -> bool:
        """Take a new, valid request into the role's queue (True), or leave it to the
        scheduler (False: a colocated request, e.g. a health check)."""

    def abort(self, rid: str) -> list[Req]:
        """Stop the request's transfer; returns the requests dropped from the role's queues,
        finished (their outputs are due). Requests in `waiting`/`running` stay the scheduler's
        to abort."""

    def before_schedule(self, state: SchedulerState) -> list[Req]:
        """Move requests on as their transfers did; returns those whose outputs are due."""

    def after_step(self, batch: StepBatch, appended: list[Req]) -> set[str]:
        """A step's results are in (tokens appended, stops checked), nothing released yet;
        returns the rids whose outputs are held back."""

    def wait(self, timeout_s: float) -> None:
        """Idle with work only here: until a transfer moves on, or `timeout_s` passes."""

    def info(self) -> dict[str, int]:
        """Queue depths and transfer counters, for /server_info."""


class ColocatedRole:
    """`--disaggregation-mode null`: every request runs here, prompt and output."""

    @property
    def has_work(self) -> bool:
        return False

    def accept(self, req: Req, bootstrap: BootstrapInfo | None) -> bool:
        return False

    def abort(self, rid: str) -> list[Req]:
        return []

    def before_schedule(self, state: SchedulerState) -> list[Req]:
        return []

    def after_step(self, batch: StepBatch, appended: list[Req]) -> set[str]:
        return set()

    def wait(self, timeout_s: float) -> None:
        pass

    def info(self) -> dict[str, int]:
        return {}
