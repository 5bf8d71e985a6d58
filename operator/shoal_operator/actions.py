"""What a plan asks the API for. `kube.apply` carries each out; creating what exists and
deleting what is gone both count as done, so a plan can be applied again after a crash."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReplaceStatus:
    """The whole new status, written against the resourceVersion the plan was made from."""

    status: dict[str, Any]

    def describe(self) -> str:
        return f"status: {self.status.get('phase')}"


@dataclass(frozen=True)
class EmitEvent:
    """A Kubernetes Event on the ModelDeployment; its name is derived from what it reports, so
    the same occurrence is never reported twice."""

    event: dict[str, Any]

    def describe(self) -> str:
        return f"event {self.event['reason']}: {self.event['message']}"


@dataclass(frozen=True)
class PodRef:
    name: str
    uid: str  # a precondition: a newer pod of the same name is never deleted by mistake


@dataclass(frozen=True)
class DeletePods:
    group: str
    pods: tuple[PodRef, ...]
    grace_seconds: int | None  # None: the pod's own terminationGracePeriodSeconds
    why: str

    def describe(self) -> str:
        return f"delete pods {', '.join(p.name for p in self.pods)} ({self.why})"


@dataclass(frozen=True)
class CreateService:
    service: dict[str, Any]

    def describe(self) -> str:
        return f"create service {self.service['metadata']['name']}"


@dataclass(frozen=True)
class CreatePods:
    group: str
    pods: tuple[dict[str, Any], ...]

    def describe(self) -> str:
        return f"create pods {', '.join(p['metadata']['name'] for p in self.pods)}"


@dataclass(frozen=True)
class CreateDeployment:
    deployment: dict[str, Any]

    def describe(self) -> str:
        return f"create deployment {self.deployment['metadata']['name']}"


@dataclass(frozen=True)
class PatchDeployment:
    """The Deployment as it should be now (a changed spec): merged over the stored one."""

    deployment: dict[str, Any]

    def describe(self) -> str:
        return f"update deployment {self.deployment['metadata']['name']}"


@dataclass(frozen=True)
class DeleteRouter:
    """The router's Deployment and Service, once the spec has no router."""

    name: str

    def describe(self) -> str:
        return f"delete deployment and service {self.name}"


@dataclass(frozen=True)
class ApplyNetworkPolicy:
    """The NetworkPolicy as it should be now: created, or merged over the stored one."""

    policy: dict[str, Any]
    exists: bool

    def describe(self) -> str:
        verb = "update" if self.exists else "create"
        return f"{verb} network policy {self.policy['metadata']['name']}"


@dataclass(frozen=True)
class DeleteNetworkPolicy:
    name: str

    def describe(self) -> str:
        return f"delete network policy {self.name}"


@dataclass(frozen=True)
class ScaleRole:
    """The autoscaler's replicas for a role: spec.replicas through the scale subresource
    (colocated groups), or spec.disaggregation.<role>.replicas."""

    role: str
    replicas: int

    def describe(self) -> str:
        return f"scale {self.role} to {self.replicas} groups"


Action = (ReplaceStatus | ScaleRole | EmitEvent | DeletePods | CreateService | CreatePods
          | CreateDeployment | PatchDeployment | DeleteRouter | ApplyNetworkPolicy
          | DeleteNetworkPolicy)
# the actions that create or change an object from its spec (what the API may refuse)
MAKES = (CreatePods, CreateService, CreateDeployment, PatchDeployment, ApplyNetworkPolicy)
