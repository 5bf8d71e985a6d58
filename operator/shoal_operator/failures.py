"""Why a group's pod ended, and what happens to the group then. Pure.

The reason comes from the one classifier the engine uses for its own exits
(`shoal.lifecycle.classify_exit`): the container's exit code, its termination message (one JSON
line the engine writes; Kubernetes' fallback to the log tail is ignored by the classifier) and
the platform's reason (`OOMKilled` -> oom).

| what ended the group                                  | verdict                              |
|-------------------------------------------------------|--------------------------------------|
| `startup-failed` (88)                                 | Fail (StartupFailed), never retried   |
| a reason not in `restartPolicy.recreateGroupOn`       | Fail (NotRecreated)                   |
| a listed reason, `maxGroupRestarts` already used      | Fail (RestartLimitReached)            |
| a listed reason otherwise                             | Restart after the backoff             |
| only `peer-lost` (75) so far, other pods still run    | Wait a moment for the cause's own end |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from shoal.lifecycle import Reason, Termination, classify_exit
from shoal_operator import names
from shoal_operator.observed import PodState
from shoal_operator.spec import RestartPolicy
from shoal_operator.status import Ending, GroupRecord, seconds_between

PEER_LOST_GRACE_S = 5.0  # how long a peer-lost end waits for the end that caused it


@dataclass(frozen=True)
class Restart:
    ending: Ending
    delay_s: int


@dataclass(frozen=True)
class Fail:
    ending: Ending
    cause: str  # StartupFailed | NotRecreated | RestartLimitReached


@dataclass(frozen=True)
class Wait:
    seconds: float


Verdict = Restart | Fail | Wait


def pod_termination(pod: PodState) -> Termination:
    assert pod.end is not None
    return classify_exit(pod.end.exit_code, component=names.CONTAINER, message=pod.end.message,
                         platform_reason=pod.end.reason)


def ending_of(pod: PodState) -> Ending:
    """The pod's end as recorded: the container's own exit code when it has one."""
    assert pod.end is not None
    end = pod_termination(pod)
    exit_code = end.exit_code if pod.end.exit_code is None else pod.end.exit_code
    return Ending(pod=pod.name, node_rank=pod.node_rank, exit_code=exit_code,
                  reason=str(end.reason), component=end.component, detail=end.detail)


def speaking_end(pods: Sequence[PodState], now: datetime) -> Ending | Wait | None:
    """The end that speaks for the group (as `shoal.lifecycle.FirstFailure` within a server): the
    first that is not `peer-lost`; a `peer-lost` end only once nothing else ended within
    PEER_LOST_GRACE_S, or every pod has ended. None while no pod has ended."""
    ended = sorted((p for p in pods if p.ended),
                   key=lambda p: (p.end.finished_at or now, p.node_rank))  # type: ignore[union-attr]
    if not ended:
        return None
    endings = [ending_of(p) for p in ended]
    for ending in endings:
        if ending.reason != Reason.PEER_LOST:
            return ending
    first = ended[0].end.finished_at  # type: ignore[union-attr]
    waited = seconds_between(first, now) if first else PEER_LOST_GRACE_S
    if waited < PEER_LOST_GRACE_S and any(not p.ended for p in pods):
        return Wait(PEER_LOST_GRACE_S - waited)
    return endings[0]


def judge(pods: Sequence[PodState], record: GroupRecord, policy: RestartPolicy,
          now: datetime) -> Verdict | None:
    """What happens to a group whose current pods are `pods`; None while none has ended."""
    end = speaking_end(pods, now)
    if end is None or isinstance(end, Wait):
        return end
    if end.reason == Reason.STARTUP_FAILED:
        return Fail(end, "StartupFailed")
    if end.reason not in policy.recreate_on:
        return Fail(end, "NotRecreated")
    if record.generation_restarts >= policy.max_group_restarts:
        return Fail(end, "RestartLimitReached")
    return Restart(end, policy.backoff.delay_s(record.generation_restarts + 1))
