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
class Recommendation:
    """What the autoscaler recommended at `time`; it stands until the next one."""

    time: str
    replicas: int


@dataclass(frozen=True)
class ScaleChange:
    """One change of a role's replicas by the autoscaler."""

    time: str
    from_replicas: int
    to_replicas: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "from": self.from_replicas, "to": self.to_replicas,
                "reason": self.reason}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ScaleChange:
        return cls(time=str(raw["time"]), from_replicas=int(raw["from"]),
                   to_replicas=int(raw["to"]), reason=str(raw.get("reason", "")))


@dataclass(frozen=True)
class ScalingRecord:
    """A role's autoscaling memory (status.autoscaling[]): what it saw last (`signal`, the
    average over `ready_groups`), what it wants (`desired_replicas`), the recommendations
    within its longest stabilization window, the changes within its longest step period, and
    the last change ever made."""

    role: str
    metric: str = ""
    signal: float | None = None
    ready_groups: int = 0
    desired_replicas: int = 0
    reason: str = ""
    recommendations: tuple[Recommendation, ...] = ()
    changes: tuple[ScaleChange, ...] = ()
    last_decision: ScaleChange | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": self.role, "metric": self.metric, "readyGroups": self.ready_groups,
            "desiredReplicas": self.desired_replicas, "reason": self.reason,
            "recommendations": [{"time": r.time, "replicas": r.replicas}
                                for r in self.recommendations],
            "changes": [c.to_dict() for c in self.changes]}
        if self.signal is not None:
            out["signal"] = self.signal
        if self.last_decision is not None:
            out["lastDecision"] = self.last_decision.to_dict()
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ScalingRecord:
        signal, last = raw.get("signal"), raw.get("lastDecision")
        return cls(role=str(raw["role"]), metric=str(raw.get("metric", "")),
                   signal=None if signal is None else float(signal),
                   ready_groups=int(raw.get("readyGroups", 0)),
                   desired_replicas=int(raw.get("desiredReplicas", 0)),
                   reason=str(raw.get("reason", "")),
                   recommendations=tuple(Recommendation(str(r["time"]), int(r["replicas"]))
                                         for r in raw.get("recommendations") or ()),
                   changes=tuple(ScaleChange.from_dict(c) for c in raw.get("changes") or ()),
                   last_decision=ScaleChange.from_dict(last) if last else None)


@dataclass(frozen=True)
class RecordedStatus:
    groups: tuple[GroupRecord, ...] = ()
    scaling: tuple[ScalingRecord, ...] = ()
    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    conditions: tuple[dict[str, Any], ...] = ()
    raw: dict[str, Any] = field(default_factory=dict)  # as read, to tell whether it changed

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RecordedStatus:
        return cls(groups=tuple(GroupRecord.from_dict(g) for g in raw.get("groups") or ()),
                   scaling=tuple(ScalingRecord.from_dict(s)
                                 for s in raw.get("autoscaling") or ()),
                   restarts_by_reason={str(k): int(v) for k, v in
                                       (raw.get("restartsByReason") or {}).items()},
                   conditions=tuple(raw.get("conditions") or ()), raw=raw)

    def group(self, name: str) -> GroupRecord | None:
        return next((g for g in self.groups if g.name == name), None)

    def scaling_of(self, role: str) -> ScalingRecord:
        return next((s for s in self.scaling if s.role == role), ScalingRecord(role))

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == kind), None)

