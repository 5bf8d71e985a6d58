"""The test-side view of the process kubelet: its pods' folders, logs and live processes."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import psutil

from tests.support.kube.binaries import REPO
from tests.support.kube.kubelet import layout
from tests.support.kube.processes import Component, start_component

NODE_NAME = "shoal-test-node"


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


@dataclass
class KubeletHandle:
    node_name: str
    root: Path  # the kubelet's state folder (see tests.support.kube.kubelet.layout)

    def pod_dir(self, namespace: str, name: str) -> Path:
        return layout.pod_dir(self.root, namespace, name)

    def pod_log(self, namespace: str, name: str) -> str:
        """stdout+stderr of the pod's containers (by name), every run, oldest first."""
        containers = sorted((self.pod_dir(namespace, name) / layout.CONTAINERS).glob("*"))
        return "".join(log.read_text(errors="replace") for container in containers
                       for log in layout.run_logs(container))

    def pod_processes(self, namespace: str, name: str) -> list[psutil.Process]:
        """The live processes of the pod's containers (each container's PID namespace)."""
        return _processes_in(self._namespaces(self.pod_dir(namespace, name)))

    def namespace_processes(self, namespace: str) -> list[psutil.Process]:
        """The live processes of every pod (now or earlier) of `namespace`."""
        return self._processes_of(f"{layout.PODS}/{namespace}/*")

    def all_pod_processes(self) -> list[psutil.Process]:
        return self._processes_of(f"{layout.PODS}/*/*")

    def _processes_of(self, pod_dirs: str) -> list[psutil.Process]:
        return _processes_in(set().union(*(self._namespaces(pod)
                                           for pod in self.root.glob(pod_dirs))))

    def node_ready(self, core: kubernetes.client.CoreV1Api) -> bool:
        try:
            node = core.read_node(self.node_name)
        except kubernetes.client.ApiException:
            return False
        return any(c.type == "Ready" and c.status == "True"
                   for c in (node.status.conditions or []))

    @staticmethod
    def _namespaces(pod_dir: Path) -> set[str]:
        own = _pid_namespace(os.getpid())
        found = set()
        for pid_file in pod_dir.glob(f"{layout.CONTAINERS}/*/{layout.PID_FILE}"):
            text = pid_file.read_text().strip()
            namespace = _pid_namespace(int(text)) if text else None
            if namespace is not None and namespace != own:
                found.add(namespace)
        return found


def _processes_in(namespaces: set[str]) -> list[psutil.Process]:
    if not namespaces:
        return []
    return [p for p in psutil.process_iter() if _pid_namespace(p.pid) in namespaces]


@dataclass
class StartedKubelet:
    handle: KubeletHandle
    component: Component


def start_kubelet(state_dir: Path, kubeconfig: Path, node_name: str = NODE_NAME) -> StartedKubelet:
    """`python -m tests.support.kube.kubelet` as a child of this process; on its parent's death
    it gets SIGTERM, and stops every pod."""
    root = state_dir / "kubelet"
    root.mkdir(parents=True, exist_ok=True)
    component = start_component(
        "process kubelet", [sys.executable, "-m", "tests.support.kube.kubelet",
                            "--kubeconfig", str(kubeconfig), "--state-dir", str(root),
                            "--node-name", node_name],
        root / "kubelet.log", cwd=REPO, parent_death_signal=signal.SIGTERM)
    return StartedKubelet(handle=KubeletHandle(node_name=node_name, root=root),
                          component=component)
