"""A pod's status from its containers' statuses, by the kubelet's rules (pure functions)."""

from __future__ import annotations

from typing import Any

CONDITION_TYPES = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady",
                   "PodScheduled")
TERMINAL_PHASES = ("Succeeded", "Failed")


def pod_phase(restart_policy: str, initialized: bool, init_failed: bool,
              containers: list[dict[str, Any]]) -> str:
    """Pending, Running, Succeeded or Failed, as the kubelet's getPhase decides it."""
    if init_failed:
        return "Failed"
    if not initialized or not containers:
        return "Pending"
    waiting = running = succeeded = failed = 0
    for status in containers:
        state = status["state"]
        if "running" in state:
            running += 1
        elif "terminated" in state:
            if state["terminated"]["exitCode"] == 0:
                succeeded += 1
            else:
                failed += 1
        elif "terminated" in status.get("lastState", {}):
            running += 1  # waiting to be restarted
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if restart_policy == "Always" or (restart_policy == "OnFailure" and failed):
        return "Running"  # every container will be restarted
    return "Failed" if failed else "Succeeded"


def _conditions(values: dict[str, tuple[bool, str]], previous: list[dict[str, Any]],
                now: str) -> list[dict[str, Any]]:
    """Conditions with `values` (type -> (status, reason)); a transition time changes only when
    the status does."""
    before = {c["type"]: c for c in previous}
    conditions = []
    for kind in CONDITION_TYPES:
        status, reason = values[kind]
        text = "True" if status else "False"
        old = before.get(kind)
        since = old["lastTransitionTime"] if old and old["status"] == text else now
        condition = {"type": kind, "status": text, "lastProbeTime": None,
                     "lastTransitionTime": since}
        if reason:
            condition["reason"] = reason
        conditions.append(condition)
    return conditions


def pod_status(*, restart_policy: str, pod_ip: str, host_ip: str, start_time: str,
               init_statuses: list[dict[str, Any]], container_statuses: list[dict[str, Any]],
               initialized: bool, init_failed: bool, previous_conditions: list[dict[str, Any]],
               now: str) -> dict[str, Any]:
    phase = pod_phase(restart_policy, initialized, init_failed, container_statuses)
    all_ready = bool(container_statuses) and all(c["ready"] for c in container_statuses)
    terminal = phase in TERMINAL_PHASES
    not_ready = "PodCompleted" if terminal else "ContainersNotReady"
    values = {
        "PodReadyToStartContainers": (True, ""),
        "PodScheduled": (True, ""),
        "Initialized": (initialized, "" if initialized else "ContainersNotInitialized"),
        "ContainersReady": (all_ready, "" if all_ready else not_ready),
        "Ready": (all_ready, "" if all_ready else not_ready),
    }
    return {
        "phase": phase, "podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}], "startTime": start_time,
        "conditions": _conditions(values, previous_conditions, now),
        "initContainerStatuses": init_statuses or None,
        "containerStatuses": container_statuses,
    }
