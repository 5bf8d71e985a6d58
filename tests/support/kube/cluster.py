"""The test cluster: etcd, kube-apiserver and kube-controller-manager as children of the session,
plus the process kubelet that runs the pods.

    running = start_cluster(state_dir)     # well under 30 s on this machine
    running.cluster.apply_file(path)       # KubeCluster: what tests use
    running.stop()                         # every pod process, then the components, by pid
"""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError

from shoal.ports import free_port
from tests.support.kube import control_plane
from tests.support.kube.binaries import REPO, kube_binaries
from tests.support.kube.credentials import (
    ADMIN_USER,
    CONTROLLER_MANAGER_USER,
    KUBELET_USER,
    Tokens,
    write_kubeconfig,
    write_signing_key,
)
from tests.support.kube.kubelet_handle import KubeletHandle, start_kubelet
from tests.support.kube.manifests import apply_manifest, load_manifests
from tests.support.kube.processes import Component, start_component

APISERVER_READY_TIMEOUT_S = 90.0
CONTROLLERS_READY_TIMEOUT_S = 60.0
CHART_CRDS = REPO / "helm" / "shoal" / "crds"


def chart_crds() -> list[Path]:
    """The Helm chart's CRD files (none until the chart has them)."""
    return sorted(CHART_CRDS.glob("*.yaml"))


@dataclass
class KubeCluster:
    server: str                 # https://127.0.0.1:PORT of the real kube-apiserver
    ca_file: Path               # CA that verifies it
    admin_kubeconfig: Path      # token kubeconfig of a system:masters user
    state_dir: Path

    def kubeconfig_for_token(self, token: str, path: Path) -> Path:
        """A kubeconfig that authenticates with `token` (a ServiceAccount's, say)."""
        return write_kubeconfig(path, server=self.server, ca_file=self.ca_file, token=token,
                                user="token-user")

    def api_client(self) -> kubernetes.client.ApiClient:
        """A client of the admin user."""
        return kubernetes.config.new_client_from_config(config_file=str(self.admin_kubeconfig))

    def dynamic_client(self) -> DynamicClient:
        return DynamicClient(self.api_client(),
                             cache_file=str(self.state_dir / f"discovery-{os.getpid()}.json"))

    def apply_file(self, path: Path, namespace: str | None = None) -> list[dict[str, Any]]:
        """Create or update every object of a (multi-document) YAML file, like `kubectl apply`
        (server-side); namespaced objects without a namespace go to `namespace` (else
        "default")."""
        client = self.dynamic_client()
        return [apply_manifest(client, doc, namespace) for doc in load_manifests(path)]


@dataclass
class RunningCluster:
    cluster: KubeCluster
    kubelet: KubeletHandle
    components: list[Component]  # in start order
    etcd_dir: Path

    def check_running(self) -> None:
        for component in self.components:
            component.check_running()

    def stop(self) -> None:
        _stop(self.components, self.etcd_dir)


def _stop(components: list[Component], etcd_dir: Path) -> None:
    """Newest first: the kubelet (it stops every pod), then the control plane."""
    for component in reversed(components):
        component.stop()
    shutil.rmtree(etcd_dir, ignore_errors=True)


def start_cluster(state_dir: Path, crd_files: list[Path] | None = None) -> RunningCluster:
    """Start the whole cluster with its state (keys, kubeconfigs, logs, pods) under `state_dir`.

    `crd_files` are applied before the controller-manager starts, so that its garbage collector
    knows their kinds as owners from the start (it looks for new kinds only every 30 s)."""
    binaries = kube_binaries()
    state_dir.mkdir(parents=True, exist_ok=True)
    tokens = Tokens.generate()
    (state_dir / "tokens.csv").write_text(tokens.auth_file())
    signing_key = write_signing_key(state_dir / "service-account.key")
    port, etcd_port = free_port(), free_port()
    server, ca_file = f"https://127.0.0.1:{port}", state_dir / "pki" / "apiserver.crt"

    def kubeconfig(name: str, token: str, user: str) -> Path:
        return write_kubeconfig(state_dir / f"{name}.kubeconfig", server=server,
                                ca_file=ca_file, token=token, user=user)

    cluster = KubeCluster(server=server, ca_file=ca_file, state_dir=state_dir,
                          admin_kubeconfig=kubeconfig("admin", tokens.admin, ADMIN_USER))
    etcd_dir = Path(tempfile.mkdtemp(prefix="shoal-kube-etcd-", dir="/dev/shm"))
    components: list[Component] = []
    try:
        components.append(start_component(
            "etcd", control_plane.etcd_argv(binaries.etcd, etcd_dir / "data", etcd_port,
                                            free_port()), state_dir / "etcd.log"))
        apiserver = start_component("kube-apiserver", control_plane.apiserver_argv(
            binaries.kube_apiserver, etcd_port=etcd_port, port=port,
            cert_dir=state_dir / "pki", token_file=state_dir / "tokens.csv",
            signing_key=signing_key), state_dir / "kube-apiserver.log")
        components.append(apiserver)
        apiserver.wait_ready(lambda: _apiserver_ready(server, ca_file), APISERVER_READY_TIMEOUT_S)
        for crd_file in crd_files or []:
            _install_crds(cluster, crd_file)
        controller_manager = start_component(
            "kube-controller-manager", control_plane.controller_manager_argv(
                binaries.kube_controller_manager, signing_key=signing_key, ca_file=ca_file,
                kubeconfig=kubeconfig("controller-manager", tokens.controller_manager,
                                      CONTROLLER_MANAGER_USER)),
            state_dir / "kube-controller-manager.log")
        components.append(controller_manager)
        kubelet = start_kubelet(state_dir, kubeconfig("kubelet", tokens.kubelet, KUBELET_USER))
        components.append(kubelet.component)
        core = kubernetes.client.CoreV1Api(cluster.api_client())
        controller_manager.wait_ready(lambda: _controllers_ready(core), CONTROLLERS_READY_TIMEOUT_S)
        kubelet.component.wait_ready(lambda: kubelet.handle.node_ready(core),
                                     CONTROLLERS_READY_TIMEOUT_S)
    except BaseException:
        _stop(components, etcd_dir)
        raise
    return RunningCluster(cluster=cluster, kubelet=kubelet.handle, components=components,
                          etcd_dir=etcd_dir)


def _install_crds(cluster: KubeCluster, path: Path) -> None:
    try:
        cluster.apply_file(path)
    except DynamicApiError as e:
        raise RuntimeError(f"kube-apiserver refuses the CRDs of {path}: {e.summary()}") from e


def _apiserver_ready(server: str, ca_file: Path) -> bool:
    if not ca_file.exists():
        return False
    try:
        return httpx.get(server + "/readyz", verify=ssl.create_default_context(
            cafile=str(ca_file)), timeout=2).text == "ok"
    except (httpx.HTTPError, ssl.SSLError):
        return False


def _controllers_ready(core: kubernetes.client.CoreV1Api) -> bool:
    """The ServiceAccount controller made `default`'s default account and the root CA publisher
    its kube-root-ca.crt: pods can be created and run in a new namespace from now on."""
    names = {sa.metadata.name for sa in core.list_namespaced_service_account("default").items}
    maps = {cm.metadata.name for cm in core.list_namespaced_config_map("default").items}
    return "default" in names and "kube-root-ca.crt" in maps
