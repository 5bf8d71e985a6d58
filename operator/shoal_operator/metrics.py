"""The operator's own /metrics (its own registry; names `shoal:operator_*`), counted from what
each reconcile pass planned: passes, group restarts by reason, scaling decisions, and per role
the replicas the spec asks for, the autoscaler's desired replicas and the Ready groups."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from shoal_operator.actions import Action, ReplaceStatus, ScaleRole
from shoal_operator.spec import ModelDeployment

LABELS = ("namespace", "modeldeployment")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.passes = Counter("shoal:operator_reconcile_passes", "Reconcile passes planned",
                              LABELS, registry=self.registry)
        self.restarts = Counter("shoal:operator_group_restarts", "Group recreations, by reason",
                                (*LABELS, "reason"), registry=self.registry)
        self.decisions = Counter("shoal:operator_scaling_decisions",
                                 "Autoscaler changes of a role's replicas, by direction",
                                 (*LABELS, "role", "direction"), registry=self.registry)
        self.replicas = Gauge("shoal:operator_replicas", "Groups the spec asks for, per role",
                              (*LABELS, "role"), registry=self.registry)
        self.desired = Gauge("shoal:operator_desired_replicas",
                             "Groups the autoscaler wants, per autoscaled role",
                             (*LABELS, "role"), registry=self.registry)
        self.ready = Gauge("shoal:operator_ready_groups", "Ready groups, per role",
                           (*LABELS, "role"), registry=self.registry)

    def serve(self, host: str, port: int) -> None:
        """GET /metrics on host:port, from a thread of its own."""
        start_http_server(port, host, registry=self.registry)

    def observe(self, md: ModelDeployment, actions: Iterable[Action]) -> None:
        """Count one pass of `md` that carried out `actions`."""
        labels = (md.namespace, md.name)
        self.passes.labels(*labels).inc()
        for role in md.spec.roles():
            self.replicas.labels(*labels, role.name).set(role.replicas)
        for action in actions:
            if isinstance(action, ScaleRole):
                current = md.spec.role(action.role).replicas
                direction = "up" if action.replicas > current else "down"
                self.decisions.labels(*labels, action.role, direction).inc()
            elif isinstance(action, ReplaceStatus):
                self._status(labels, md.status.restarts_by_reason, action.status)

    def _status(self, labels: tuple[str, str], before: dict[str, int],
                status: dict[str, Any]) -> None:
        for reason, count in (status.get("restartsByReason") or {}).items():
            if count > before.get(reason, 0):
                self.restarts.labels(*labels, reason).inc(count - before.get(reason, 0))
        for record in status.get("autoscaling") or ():
            self.desired.labels(*labels, record["role"]).set(record["desiredReplicas"])
        ready: dict[str, int] = {}
        for group in status.get("groups") or ():
            ready[group["role"]] = ready.get(group["role"], 0) + (group["phase"] == "Ready")
        for role, count in ready.items():
            self.ready.labels(*labels, role).set(count)
