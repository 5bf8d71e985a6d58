"""The ModelDeployment's phase and its conditions Available, Progressing and Degraded. Pure.

| condition   | True when                                                                |
|-------------|--------------------------------------------------------------------------|
| Available   | at least one group is Ready and no more than `maxUnavailable` are not    |
| Progressing | groups are being created, restarted, rolled or removed                   |
| Degraded    | a group is Failed (startup failure, restart limit, a reason not listed), |
|             | the spec is refused (refusals.py: reason HostPathNotAllowed), or the API |
|             | refuses what the operator creates for it (CreateRefused: admission,      |
|             | quota, validation; retried until it is accepted)                         |

Phase: `Failed` when every desired group is Failed, `Degraded` when some are, `Ready` when every
desired group is Ready on the current template and nothing else is in flight, else
`Progressing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shoal_operator.status import GroupRecord, RecordedStatus, format_time


@dataclass(frozen=True)
class Summary:
    replicas: int  # desired groups
    ready: int
    max_unavailable: int
    failed: tuple[GroupRecord, ...]  # desired groups that are Failed
    settled: bool  # every desired group Ready on the current template (or Failed), no extras
    progress: str  # the reason Progressing gives while not settled
    create_refused: str = ""  # the API's refusal of a create this plan repeats


def phase(summary: Summary) -> str:
    if summary.failed and len(summary.failed) >= summary.replicas:
        return "Failed"
    if summary.failed:
        return "Degraded"
    return "Ready" if summary.settled else "Progressing"


def conditions(summary: Summary, previous: RecordedStatus, generation: int,
               now: datetime) -> list[dict[str, Any]]:
    wanted = [("Available", *_available(summary)), ("Progressing", *_progressing(summary)),
              ("Degraded", *_degraded(summary))]
    return _stamped(wanted, previous, generation, now)


def refused_conditions(reason: str, message: str, previous: RecordedStatus, generation: int,
                       now: datetime) -> list[dict[str, Any]]:
    """A spec the operator refuses (refusals.py): Degraded with the refusal's reason."""
    wanted = [("Available", "False", "SpecRefused", message),
              ("Progressing", "False", "SpecRefused", "nothing is created until the spec "
                                                      "changes"),
              ("Degraded", "True", reason, message)]
    return _stamped(wanted, previous, generation, now)


def _stamped(wanted: list[tuple[str, str, str, str]], previous: RecordedStatus,
             generation: int, now: datetime) -> list[dict[str, Any]]:
    """The conditions with their lastTransitionTime kept while their status stays."""
    out = []
    for kind, status, reason, message in wanted:
        before = previous.condition(kind)
        since = (before["lastTransitionTime"]
                 if before and before.get("status") == status and before.get("lastTransitionTime")
                 else format_time(now))
        out.append({"type": kind, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": since, "observedGeneration": generation})
    return out


def _available(s: Summary) -> tuple[str, str, str]:
    message = f"{s.ready} of {s.replicas} groups ready"
    if s.replicas == 0:
        return "False", "ScaledToZero", message
    if s.ready >= max(1, s.replicas - s.max_unavailable):
        return "True", "MinimumGroupsReady", message
    return "False", "GroupsUnavailable", message


def _progressing(s: Summary) -> tuple[str, str, str]:
    if s.settled and s.failed:
        return "False", "Stalled", "failed groups wait for a spec change"
    if s.settled:
        return "False", "Complete", f"{s.ready} of {s.replicas} groups ready on the current spec"
    return "True", s.progress, f"{s.ready} of {s.replicas} groups ready"


def _degraded(s: Summary) -> tuple[str, str, str]:
    if s.failed:
        failed = s.failed[0]
        detail = failed.last_termination.describe() if failed.last_termination else ""
        more = f" (and {len(s.failed) - 1} more)" if len(s.failed) > 1 else ""
        return "True", failed.failed_reason or "GroupFailed", \
            f"group {failed.name} failed{more}: {detail}"
    if s.create_refused:
        return "True", "CreateRefused", s.create_refused
    return "False", "NoFailedGroups", "no group has failed"

