"""What the operator reads back from the API about a ModelDeployment's children. Pure.

Pods are parsed from their API objects (camelCase dicts): the group, replica, node rank,
incarnation and template hash from the labels the builders put there, readiness, and how the
container ended (`state.terminated`: exit code, the platform's reason such as `OOMKilled`,
the termination message). For autoscaling, the load signals of each Ready group's node-0
server, parsed from its /metrics (Prometheus text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from shoal_operator import names
from shoal_operator.status import parse_time

ENDED_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class ContainerEnd:
    exit_code: int | None
    reason: str | None  # the platform's word: OOMKilled, Error, Completed, Evicted, ...
    message: str | None  # the termination message (or Kubernetes' fallback: the log tail)
    finished_at: datetime | None


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    owner_uid: str | None  # the controlling ModelDeployment
    group: str
    role: str
    replica: int
    node_rank: int
    incarnation: int
    template_hash: str
    phase: str
    ready: bool
    terminating: bool  # deletion requested
    end: ContainerEnd | None  # set once the engine container (or the pod) has ended
    pod_ip: str | None = None

    @property
    def ended(self) -> bool:
        return self.end is not None

    @property
    def live(self) -> bool:
        """Running or starting, and nobody asked it to go."""
        return not self.ended and not self.terminating

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> PodState | None:
        """None for a pod without the operator's labels (not one of ours)."""
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        status = obj.get("status") or {}
        try:
            replica = int(labels[names.REPLICA])
            node_rank = int(labels[names.NODE_RANK])
            incarnation = int(labels.get(names.INCARNATION, 0))
            group = labels[names.GROUP_LABEL]
        except (KeyError, ValueError):
            return None
        owner = next((ref.get("uid") for ref in meta.get("ownerReferences") or ()
                      if ref.get("controller")), None)
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or ())
        return cls(name=meta["name"], uid=meta.get("uid", ""), owner_uid=owner, group=group,
                   role=labels.get(names.COMPONENT, names.ENGINE_ROLE), replica=replica,
                   node_rank=node_rank, incarnation=incarnation,
                   template_hash=labels.get(names.TEMPLATE_HASH, ""),
                   phase=status.get("phase", "Pending"), ready=ready,
                   terminating=bool(meta.get("deletionTimestamp")),
                   end=_container_end(status), pod_ip=status.get("podIP"))


def _container_end(status: dict[str, Any]) -> ContainerEnd | None:
    for container in status.get("containerStatuses") or ():
        if container.get("name") != names.CONTAINER:
            continue
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            return ContainerEnd(exit_code=terminated.get("exitCode"),
                                reason=terminated.get("reason"),
                                message=terminated.get("message"),
                                finished_at=parse_time(terminated.get("finishedAt")))
    if status.get("phase") in ENDED_PHASES:  # ended without a container status (evicted, ...)
        return ContainerEnd(exit_code=None, reason=status.get("reason"),
                            message=status.get("message"), finished_at=None)
    return None


# spec.autoscaling's metric -> the engine's gauge (docs/operations.md)
SIGNAL_GAUGES = {"queuedRequests": "shoal:num_queue_reqs",
                 "runningRequests": "shoal:num_running_reqs",
                 "kvCacheUsage": "shoal:token_usage"}


@dataclass(frozen=True)
class EngineSignals:
    """The load signals one server's /metrics reported (a gauge it did not report: None)."""

    values: tuple[tuple[str, float], ...] = ()

    def value(self, metric: str) -> float | None:
        return dict(self.values).get(metric)

    @classmethod
    def from_metrics(cls, text: str) -> EngineSignals:
        """From the Prometheus text format; a gauge of several samples is summed."""
        by_gauge = {gauge: metric for metric, gauge in SIGNAL_GAUGES.items()}
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                metric = by_gauge.get(sample.name)
                if metric is not None:
                    found[metric] = found.get(metric, 0.0) + float(sample.value)
        return cls(tuple(sorted(found.items())))


@dataclass(frozen=True)
class Observed:
    """A ModelDeployment's pods, Services, Deployments (the router's) and NetworkPolicies as
    listed by its instance label; a Deployment or NetworkPolicy by name with its
    `shoal.dev/template-hash` label."""

    pods: tuple[PodState, ...] = ()
    services: frozenset[str] = frozenset()
    deployments: tuple[tuple[str, str], ...] = ()
    network_policies: tuple[tuple[str, str], ...] = ()
    signals: tuple[tuple[str, EngineSignals], ...] = ()  # by group: its node-0 /metrics
    # the API's refusal of a create of the pass before (a 400, 403 or 422: admission, quota,
    # validation), verbatim; "" when that pass created all it planned
    create_refused: str = ""

    @classmethod
    def from_objects(cls, pods: list[dict[str, Any]], services: list[dict[str, Any]],
                     deployments: Sequence[dict[str, Any]] = (),
                     network_policies: Sequence[dict[str, Any]] = ()) -> Observed:
        parsed = (PodState.from_object(p) for p in pods)
        return cls(pods=tuple(p for p in parsed if p is not None),
                   services=frozenset(s["metadata"]["name"] for s in services),
                   deployments=_hashes(deployments), network_policies=_hashes(network_policies))

    def deployment_hash(self, name: str) -> str | None:
        """The template hash of the Deployment of that name; None when there is none."""
        return dict(self.deployments).get(name)

    def network_policy_hash(self, name: str) -> str | None:
        return dict(self.network_policies).get(name)

    def signal(self, group: str, metric: str) -> float | None:
        found = dict(self.signals).get(group)
        return None if found is None else found.value(metric)


def _hashes(objects: Sequence[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((o["metadata"]["name"],
                         (o["metadata"].get("labels") or {}).get(names.TEMPLATE_HASH, ""))
                        for o in objects))
