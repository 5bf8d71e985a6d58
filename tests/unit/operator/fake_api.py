"""An in-memory stand-in for the API and the kubelet, enough to run plans end to end: actions
are applied as the apiserver would (names are unique, deletes honour the uid precondition), and
the test plays the kubelet (pods start, become ready, end, go away)."""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import replace
from datetime import datetime
from typing import Any

from shoal_operator import names
from shoal_operator.actions import (
    Action,
    ApplyNetworkPolicy,
    CreateDeployment,
    CreatePods,
    CreateService,
    DeleteNetworkPolicy,
    DeletePods,
    DeleteRouter,
    EmitEvent,
    PatchDeployment,
    ReplaceStatus,
    ScaleRole,
)
from shoal_operator.observed import EngineSignals, Observed
from shoal_operator.planner import Plan, plan
from shoal_operator.spec import ModelDeployment
from tests.unit.operator.factories import CONFIG, end_pod, md_body


class FakeApi:
    def __init__(self, spec: dict[str, Any] | None = None) -> None:
        self.body = md_body(spec)
        self.pods: dict[str, dict[str, Any]] = {}
        self.services: dict[str, dict[str, Any]] = {}
        self.deployments: dict[str, dict[str, Any]] = {}
        self.network_policies: dict[str, dict[str, Any]] = {}
        self.events: dict[str, dict[str, Any]] = {}
        self.created: list[str] = []  # every pod creation, in order
        self.signals: dict[str, EngineSignals] = {}  # by group: what its node-0 /metrics says
        self._uids = itertools.count(1)

    # -- what the operator reads back -----------------------------------------------------

    def md(self) -> ModelDeployment:
        return ModelDeployment.from_body(copy.deepcopy(self.body), CONFIG.default_image)

    def observed(self) -> Observed:
        observed = Observed.from_objects(copy.deepcopy(list(self.pods.values())),
                                         list(self.services.values()),
                                         list(self.deployments.values()),
                                         list(self.network_policies.values()))
        return replace(observed, signals=tuple(sorted(self.signals.items())))

    def plan(self, now: datetime) -> Plan:
        return plan(self.md(), self.observed(), now, CONFIG)

    def step(self, now: datetime, crash_after: int | None = None) -> Plan:
        """Plan and apply (only the first `crash_after` actions: the operator died there)."""
        result = self.plan(now)
        for action in result.actions[:crash_after]:
            self.apply(action)
        return result

    def apply(self, action: Action) -> None:
        if isinstance(action, ReplaceStatus):
            self.body["status"] = json.loads(json.dumps(action.status))
            self.body["metadata"]["resourceVersion"] = str(
                int(self.body["metadata"]["resourceVersion"]) + 1)
        elif isinstance(action, ScaleRole):
            spec = self.body["spec"]
            target = spec if action.role == names.ENGINE_ROLE else \
                spec["disaggregation"][action.role]
            target["replicas"] = action.replicas
            self.body["metadata"]["generation"] += 1
        elif isinstance(action, EmitEvent):
            self.events.setdefault(action.event["metadata"]["name"], action.event)
        elif isinstance(action, CreateService):
            self.services.setdefault(action.service["metadata"]["name"], action.service)
        elif isinstance(action, CreateDeployment):
            self.deployments.setdefault(action.deployment["metadata"]["name"],
                                        copy.deepcopy(action.deployment))
        elif isinstance(action, PatchDeployment):
            self.deployments[action.deployment["metadata"]["name"]] = copy.deepcopy(
                action.deployment)
        elif isinstance(action, ApplyNetworkPolicy):
            self.network_policies[action.policy["metadata"]["name"]] = copy.deepcopy(
                action.policy)
        elif isinstance(action, DeleteNetworkPolicy):
            self.network_policies.pop(action.name, None)
        elif isinstance(action, DeleteRouter):
            self.deployments.pop(action.name, None)
            self.services.pop(action.name, None)
        elif isinstance(action, CreatePods):
            for template in action.pods:
                name = template["metadata"]["name"]
                if name in self.pods:
                    continue
                pod = copy.deepcopy(template)
                pod["metadata"]["uid"] = f"uid-{next(self._uids)}"
                pod["status"] = {"phase": "Pending"}
                self.pods[name] = pod
                self.created.append(name)
        elif isinstance(action, DeletePods):
            for ref in action.pods:
                pod = self.pods.get(ref.name)
                if pod is not None and pod["metadata"]["uid"] == ref.uid:
                    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"

    # -- the kubelet's part ---------------------------------------------------------------

    def start_all(self) -> None:
        """Every pod that is neither ended nor terminating runs and is Ready."""
        for pod in self.pods.values():
            if pod["status"].get("phase") in ("Pending", "Running") and \
                    "deletionTimestamp" not in pod["metadata"]:
                pod["status"] = {"phase": "Running", "conditions": [
                    {"type": "Ready", "status": "True"}], "containerStatuses": [
                    {"name": names.CONTAINER, "ready": True, "state": {"running": {}}}]}

    def remove_terminating(self) -> None:
        self.pods = {n: p for n, p in self.pods.items() if "deletionTimestamp" not in p["metadata"]}

    def end(self, pod_name: str, exit_code: int, **kwargs: Any) -> None:
        self.pods[pod_name] = end_pod(self.pods[pod_name], exit_code, **kwargs)

    def converge(self, now: datetime, rounds: int = 10) -> None:
        """Play kubelet and operator until the plan is empty."""
        for _ in range(rounds):
            self.remove_terminating()
            self.start_all()
            if not self.step(now).actions:
                return
        raise AssertionError(f"no steady state after {rounds} rounds: {self.plan(now).actions}")

    # -- views for assertions -------------------------------------------------------------

    @property
    def status(self) -> dict[str, Any]:
        return self.body["status"]

    def group_status(self, name: str) -> dict[str, Any]:
        return next(g for g in self.status["groups"] if g["name"] == name)

    def condition(self, kind: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == kind)

    def live_pods(self) -> list[str]:
        return sorted(n for n, p in self.pods.items()
                      if "deletionTimestamp" not in p["metadata"]
                      and p["status"].get("phase") in ("Pending", "Running"))

    def change_spec(self, **changes: Any) -> None:
        self.body["spec"].update(copy.deepcopy(changes))
        self.body["metadata"]["generation"] += 1
