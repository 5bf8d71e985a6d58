"""ModelDeployments, pods and a fake clock for the planner's tests, as the API would show them."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from shoal.lifecycle import Reason, Termination
from shoal_operator import builders, names
from shoal_operator.config import OperatorConfig
from shoal_operator.spec import ModelDeployment

CONFIG = OperatorConfig(default_image="shoal:test")
MD_UID = "0123456789abcdef"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


def md_body(spec: dict[str, Any] | None = None, *, name: str = "llm", generation: int = 1,
            status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": MD_UID,
                         "generation": generation, "resourceVersion": "1"},
            "spec": copy.deepcopy(spec or {}), "status": copy.deepcopy(status or {})}


def make_md(spec: dict[str, Any] | None = None, **kwargs: Any) -> ModelDeployment:
    return ModelDeployment.from_body(md_body(spec, **kwargs), CONFIG.default_image)


def pod_object(md: ModelDeployment, replica: int, node_rank: int, *, incarnation: int = 0,
               template_hash: str | None = None, uid: str | None = None,
               ready: bool = False, owner_uid: str = MD_UID) -> dict[str, Any]:
    """A pod as the operator created it (running, ready or not)."""
    pod = builders.build_pod(md, CONFIG, replica, node_rank, incarnation,
                             template_hash or builders.template_hash(md, CONFIG))
    pod["metadata"]["uid"] = uid or f"uid-{pod['metadata']['name']}-{incarnation}"
    pod["metadata"]["ownerReferences"][0]["uid"] = owner_uid
    pod["status"] = {"phase": "Running", "podIP": f"127.0.1.{node_rank + 1}",
                     "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                     "containerStatuses": [{"name": names.CONTAINER, "ready": ready,
                                            "state": {"running": {}}}]}
    return pod


def end_pod(pod: dict[str, Any], exit_code: int, *, reason: Reason | None = None,
            detail: str = "it ended", platform_reason: str = "Error", message: str | None = None,
            finished_at: datetime = T0) -> dict[str, Any]:
    """The pod after its engine exited: the termination message as the engine writes it (one
    JSON line) unless `message` is given."""
    if message is None and reason is not None:
        message = Termination(reason, "scheduler_TP1", 1, exit_code, detail).to_json() + "\n"
    pod = copy.deepcopy(pod)
    pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    terminated = {"exitCode": exit_code, "reason": platform_reason,
                  "finishedAt": finished_at.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if message is not None:
        terminated["message"] = message
    pod["status"]["containerStatuses"] = [{"name": names.CONTAINER, "ready": False,
                                           "state": {"terminated": terminated}}]
    return pod


def terminating(pod: dict[str, Any]) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return pod
