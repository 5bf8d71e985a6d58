"""The one Node of the test cluster, and which pods may be bound to it."""

from __future__ import annotations

import os
import platform
from typing import Any

import psutil

from tests.support.kube.kubelet.timestamps import rfc3339

ARCHITECTURES = {"x86_64": "amd64", "aarch64": "arm64"}
DEFAULT_SCHEDULER = "default-scheduler"


def node_labels(name: str) -> dict[str, str]:
    arch = ARCHITECTURES.get(platform.machine(), platform.machine())
    return {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": arch, "beta.kubernetes.io/os": "linux",
            "beta.kubernetes.io/arch": arch}


def build_node(name: str, host_ip: str, kubelet_version: str) -> dict[str, Any]:
    now = rfc3339()
    resources = {"cpu": str(os.cpu_count()), "memory": str(psutil.virtual_memory().total),
                 "pods": "250", "ephemeral-storage": str(psutil.disk_usage("/").total)}
    pressure = [{"type": kind, "status": "False", "reason": f"KubeletHasNo{kind}",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}
                for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")]
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": node_labels(name)},
        "spec": {},
        "status": {
            "capacity": resources, "allocatable": resources,
            "conditions": [*pressure, {
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "process kubelet is posting ready status",
                "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": host_ip},
                          {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": kubelet_version, "operatingSystem": "linux",
                         "architecture": ARCHITECTURES.get(platform.machine(), ""),
                         "kernelVersion": platform.release(), "osImage": platform.platform(),
                         "containerRuntimeVersion": "process://shoal-test",
                         "machineID": "", "systemUUID": "", "bootID": ""},
        },
    }


def unschedulable_reason(pod: dict[str, Any], labels: dict[str, str]) -> str | None:
    """Why the one node cannot take `pod` (nodeSelector only; affinity is not emulated)."""
    selector = pod["spec"].get("nodeSelector") or {}
    mismatched = {k: v for k, v in selector.items() if labels.get(k) != v}
    if mismatched:
        return f"0/1 nodes are available: 1 node(s) didn't match Pod's node selector {mismatched}"
    return None
