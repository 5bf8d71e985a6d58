"""The ModelDeployment's status, read back and written: the operator's only memory. Pure.

Everything a restarted operator must know lives here or on the pods: per group, how many times
it was recreated (`restarts`), which life of the group its pods belong to (`incarnation`, also a
pod label), the backoff deadline (`recreateAfter`), the restarts counted against
`maxGroupRestarts` at this spec generation, and the generation a group went Failed at.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any


def format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_deadline(moment: datetime) -> str:
    """A deadline rounded up to the whole second (never earlier than asked)."""
    whole = moment.replace(microsecond=0)
    return format_time(whole if whole == moment else whole + timedelta(seconds=1))


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text)


def seconds_between(start: datetime, end: datetime) -> float:
    return (end - start).total_seconds()


@dataclass(frozen=True)
class Ending:
    """The pod end that spoke for a group's last restart or failure."""

    pod: str
    node_rank: int
    exit_code: int
    reason: str
    component: str
    detail: str

    def describe(self) -> str:
        return (f"pod {self.pod} (node rank {self.node_rank}) exited {self.exit_code} "
                f"({self.reason}, {self.component}): {self.detail}")

    def to_dict(self) -> dict[str, Any]:
        return {"pod": self.pod, "nodeRank": self.node_rank, "exitCode": self.exit_code,
                "reason": self.reason, "component": self.component, "detail": self.detail}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Ending:
        return cls(pod=str(raw.get("pod", "")), node_rank=int(raw.get("nodeRank", 0)),
                   exit_code=int(raw.get("exitCode", 0)), reason=str(raw.get("reason", "")),
                   component=str(raw.get("component", "")), detail=str(raw.get("detail", "")))


@dataclass(frozen=True)
class GroupRecord:
    name: str
    role: str
    replica: int
    phase: str = "Pending"
    restarts: int = 0
    last_restart_reason: str | None = None
    last_restart_time: str | None = None
    incarnation: int = 0
    generation: int = 0  # the spec generation `generation_restarts` counts at
    generation_restarts: int = 0  # restarts counted against maxGroupRestarts
    recreate_after: str | None = None
    failed_generation: int | None = None
    failed_reason: str | None = None  # StartupFailed | NotRecreated | RestartLimitReached
    last_termination: Ending | None = None

    @property
    def failed(self) -> bool:
        return self.failed_generation is not None

    def with_phase(self, phase: str) -> GroupRecord:
        return replace(self, phase=phase)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "role": self.role, "replica": self.replica, "phase": self.phase,
            "restarts": self.restarts, "incarnation": self.incarnation,
            "generation": self.generation, "generationRestarts": self.generation_restarts,
        }
        optional = {"lastRestartReason": self.last_restart_reason,
                    "lastRestartTime": self.last_restart_time,
                    "recreateAfter": self.recreate_after,
                    "failedGeneration": self.failed_generation,
                    "failedReason": self.failed_reason,
                    "lastTermination": self.last_termination and self.last_termination.to_dict()}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GroupRecord:
        failed = raw.get("failedGeneration")
        ending = raw.get("lastTermination")
        return cls(name=str(raw["name"]), role=str(raw.get("role", "engine")),
                   replica=int(raw.get("replica", 0)), phase=str(raw.get("phase", "Pending")),
                   restarts=int(raw.get("restarts", 0)),
                   last_restart_reason=raw.get("lastRestartReason"),
                   last_restart_time=raw.get("lastRestartTime"),
                   incarnation=int(raw.get("incarnation", 0)),
                   generation=int(raw.get("generation", 0)),
                   generation_restarts=int(raw.get("generationRestarts", 0)),
                   recreate_after=raw.get("recreateAfter"),
                   failed_generation=None if failed is None else int(failed),
                   failed_reason=raw.get("failedReason"),
                   last_termination=Ending.from_dict(ending) if ending else None)


@dataclass(frozen=True)
class RecordedStatus:
    groups: tuple[GroupRecord, ...] = ()
    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    conditions: tuple[dict[str, Any], ...] = ()
    raw: dict[str, Any] = field(default_factory=dict)  # as read, to tell whether it changed

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RecordedStatus:
        return cls(groups=tuple(GroupRecord.from_dict(g) for g in raw.get("groups") or ()),
                   restarts_by_reason={str(k): int(v) for k, v in
                                       (raw.get("restartsByReason") or {}).items()},
                   conditions=tuple(raw.get("conditions") or ()), raw=raw)

    def group(self, name: str) -> GroupRecord | None:
        return next((g for g in self.groups if g.name == name), None)

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == kind), None)

