"""Where the process kubelet keeps each pod's files (shared with the test-side KubeletHandle).

    <root>/kubelet.log                               what the kubelet did
    <root>/pods/<namespace>/<name>/                  the pod running under that name now
        hosts, hostname                              bind-mounted at /etc/hosts, /etc/hostname
        volumes/<volume>/                            emptyDir, configMap, secret, projected ...
        containers/<container>/run-<n>.log           stdout+stderr of the container's n-th run
        containers/<container>/termination-log       bind-mounted at terminationMessagePath
        containers/<container>/pid                   host pid of the container's PID 1
    <root>/pods/<namespace>/<name>@<uid>/            an earlier pod of the same name
"""

from __future__ import annotations

import re
from pathlib import Path

PODS = "pods"
CONTAINERS = "containers"
PID_FILE = "pid"
TERMINATION_LOG = "termination-log"
_RUN_LOG = re.compile(r"run-(\d+)\.log")


def pod_dir(root: Path, namespace: str, name: str) -> Path:
    return root / PODS / namespace / name


def retired_pod_dir(root: Path, namespace: str, name: str, uid: str) -> Path:
    return root / PODS / namespace / f"{name}@{uid}"


def container_dir(pod: Path, container: str) -> Path:
    return pod / CONTAINERS / container


def run_log(container: Path, run: int) -> Path:
    return container / f"run-{run}.log"


def run_logs(container: Path) -> list[Path]:
    """A container's run logs, oldest first."""
    runs = [(int(m.group(1)), p) for p in container.glob("run-*.log")
            if (m := _RUN_LOG.fullmatch(p.name))]
    return [p for _, p in sorted(runs)]
