"""The operator against the real test cluster: the CRD from helm/shoal/crds/, the operator as a
subprocess (`python -m shoal_operator` with the admin kubeconfig) that tests can kill and start
again, and a small client for ModelDeployments, their pods, Events and endpoints."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import psutil
import pytest

from shoal.ports import free_port
from tests.support.kube.binaries import REPO
from tests.support.kube.cluster import KubeCluster, RunningCluster
from tests.support.kube.kubelet_handle import KubeletHandle
from tests.support.kube.processes import Component, start_component
from tests.support.wait import wait_until

CRD_FILE = REPO / "helm" / "shoal" / "crds" / "modeldeployments.shoal.dev.yaml"
GROUP, VERSION, PLURAL = "shoal.dev", "v1alpha1", "modeldeployments"
GROUP_READY_S = 300.0  # model loading in every pod on 2 shared cores
PODS_GONE_S = 120.0
# small and quick: a short watchdog, a short backoff, a small KV pool
ENGINE_ARGS = ["--max-total-tokens", "4096", "--watchdog-timeout", "5"]
# the engine pods of a two-node group, or a prefill and a decode server, share this host's
# cores: one core each, as a CPU limit (the kubelet's CFS quota), which each rank sizes its
# threads by; without it both count every core, and their threads outnumber the cores (a decode
# step ~4x slower)
ONE_CORE_EACH = {"limits": {"cpu": "1"}}


def rendezvous_env(namespace: str, name: str) -> dict[str, str]:
    """SHOAL_DIST_INIT_ADDR for group 0 of `name` with a free port instead of the operator's
    29500: torch's TCPStore binds the wildcard address, and every pod here shares the host's
    network, so groups of parallel test sessions on one machine would meet on 29500. The
    address is still the leader's DNS name the operator hands out."""
    host = f"{name}-0-0.{name}-nodes.{namespace}.svc.cluster.local"
    return {"name": "SHOAL_DIST_INIT_ADDR", "value": f"{host}:{free_port()}"}


# every operator of the session elects its leader through this Lease, so a test may start a
# standby beside the session's operator
LEASE_NAMESPACE, LEASE_NAME = "default", "shoal-operator-e2e"


class Operator:
    """`python -m shoal_operator --leader-election` as a child of the test session."""

    def __init__(self, kubeconfig: Path, log_path: Path) -> None:
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.component: Component | None = None
        self.metrics_url = f"http://127.0.0.1:{free_port()}"

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        self.component = start_component(
            "shoal-operator", [sys.executable, "-m", "shoal_operator", "--health-port", "0",
                               "--health-host", "127.0.0.1", "--metrics-port",
                               self.metrics_url.rsplit(":", 1)[1],
                               "--leader-election", "--leader-election-namespace",
                               LEASE_NAMESPACE, "--leader-election-id", LEASE_NAME],
            self.log_path, cwd=REPO, env=env)

    def kill(self) -> None:
        """SIGKILL: no chance to finish anything it was doing."""
        assert self.component is not None
        self.component.proc.send_signal(signal.SIGKILL)
        self.component.proc.wait()

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()

    def check_running(self) -> None:
        assert self.component is not None
        self.component.check_running()


@pytest.fixture(scope="session")
def crd(kube_cluster: KubeCluster) -> Path:
    kube_cluster.apply_file(CRD_FILE)
    ext = kubernetes.client.ApiextensionsV1Api(kube_cluster.api_client())
    wait_until(lambda: any(c.type == "Established" and c.status == "True" for c in
                           ext.read_custom_resource_definition(f"{PLURAL}.{GROUP}").status
                           .conditions or []), 30, what="CRD not established")
    return CRD_FILE


@pytest.fixture(scope="session")
def operator(kube_cluster: KubeCluster, crd: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    running = Operator(kube_cluster.admin_kubeconfig,
                       tmp_path_factory.mktemp("operator") / "operator.log")
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def module_namespace(request: pytest.FixtureRequest,
                     running_cluster: RunningCluster) -> Iterator[str]:
    """A namespace shared by the tests of one module (they share a running group); deleted at
    the end, waiting until its pods and their processes are gone."""
    core = kubernetes.client.CoreV1Api(running_cluster.cluster.api_client())
    name = f"{re.sub(r'[^a-z0-9]+', '-', request.module.__name__.split('.')[-1])[:40]}-" \
           f"{uuid.uuid4().hex[:6]}".replace("_", "-")
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)
    wait_until(lambda: not core.list_namespaced_pod(name).items, PODS_GONE_S,
               what=f"pods of namespace {name} still there")
    wait_until(lambda: not running_cluster.kubelet.namespace_processes(name), PODS_GONE_S,
               what=f"processes of {name}'s pods still running")


@dataclass
class Deployments:
    """ModelDeployments of one namespace, their pods, Events and serving address."""

    cluster: KubeCluster
    kubelet: KubeletHandle
    namespace: str

    def __post_init__(self) -> None:
        client = self.cluster.api_client()
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.discovery = kubernetes.client.DiscoveryV1Api(client)

    # -- the resource --------------------------------------------------------------------

    def create(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelDeployment",
                "metadata": {"name": name}, "spec": spec}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                           PLURAL, body)

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                        PLURAL, name)

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name,
                                                   {"spec": spec})

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                    name)

    def exists(self, name: str) -> bool:
        try:
            self.get(name)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        return next(c for c in self.status(name).get("conditions", []) if c["type"] == kind)

    def wait_ready(self, name: str, timeout: float = GROUP_READY_S) -> dict[str, Any]:
        """Until every group is Ready on the current spec, with no pod on its way out."""
        def ready() -> dict[str, Any] | None:
            md = self.get(name)
            status = md.get("status") or {}
            pods = self.pods(name)
            settled = (status.get("phase") == "Ready"
                       and status.get("observedGeneration") == md["metadata"]["generation"]
                       and not any(p.metadata.deletion_timestamp for p in pods))
            return status if settled else None
        return wait_until(ready, timeout, interval=0.5, what=f"{name} not Ready")

    # -- what it made --------------------------------------------------------------------

    def pods(self, name: str) -> list[Any]:
        return self.core.list_namespaced_pod(
            self.namespace, label_selector=f"app.kubernetes.io/instance={name}").items

    def pod_uids(self, name: str) -> dict[str, str]:
        return {p.metadata.name: p.metadata.uid for p in self.pods(name)}

    def services(self, name: str) -> list[str]:
        return [s.metadata.name for s in self.core.list_namespaced_service(
            self.namespace, label_selector=f"app.kubernetes.io/instance={name}").items]

    def events(self, name: str) -> list[Any]:
        return [e for e in self.core.list_namespaced_event(self.namespace).items
                if e.involved_object.kind == "ModelDeployment"
                and e.involved_object.name == name]

    def rank_process(self, pod: str, title: str) -> psutil.Process:
        """The pod's process whose title is `title` (e.g. shoal::scheduler_TP1)."""
        def find() -> psutil.Process | None:
            for proc in self.kubelet.pod_processes(self.namespace, pod):
                try:
                    if " ".join(proc.cmdline()).startswith(title):
                        return proc
                except psutil.Error:
                    continue
            return None
        return wait_until(find, 30, what=f"no {title} in pod {pod}")

    def serving_address(self, name: str) -> str:
        """http://IP:PORT of a ready endpoint of the ModelDeployment's Service, as its
        EndpointSlice lists it (the real controller-manager writes it)."""
        def address() -> str | None:
            for slice_ in self.discovery.list_namespaced_endpoint_slice(
                    self.namespace, label_selector=f"kubernetes.io/service-name={name}").items:
                port = next((p.port for p in slice_.ports or [] if p.name == "http"), None)
                for endpoint in slice_.endpoints or []:
                    if endpoint.conditions.ready and port:
                        return f"http://{endpoint.addresses[0]}:{port}"
            return None
        return wait_until(address, 60, what=f"no ready endpoint of Service {name}")

    def chat(self, name: str, max_tokens: int = 8, timeout: float = 120,
             ignore_eos: bool = False) -> httpx.Response:
        return httpx.post(f"{self.serving_address(name)}/v1/chat/completions", timeout=timeout,
                          json={"messages": [{"role": "user", "content": "Say hello."}],
                                "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": ignore_eos})

    def chat_until_it_breaks(self, name: str, max_tokens: int) -> None:
        """A request of exactly `max_tokens` tokens, meant to reach an injected fault: the
        server may go away in the middle of it."""
        with contextlib.suppress(httpx.HTTPError):
            self.chat(name, max_tokens=max_tokens, timeout=90, ignore_eos=True)


@pytest.fixture(scope="module")
def module_deployments(kube_cluster: KubeCluster, kubelet: KubeletHandle, operator: Operator,
                       module_namespace: str) -> Deployments:
    return Deployments(kube_cluster, kubelet, module_namespace)


@pytest.fixture
def deployments(kube_cluster: KubeCluster, kubelet: KubeletHandle, operator: Operator,
                namespace: str) -> Deployments:
    return Deployments(kube_cluster, kubelet, namespace)


def wait_restarted(mds: Deployments, name: str, reason: str, count: int,
                   old_uids: dict[str, str], timeout: float = 120) -> dict[str, Any]:
    """Until `restartsByReason[reason]` reaches `count` and every old pod is gone."""
    def restarted() -> dict[str, Any] | None:
        status = mds.status(name)
        counted = (status.get("restartsByReason") or {}).get(reason, 0) >= count
        gone = not set(old_uids.values()) & set(mds.pod_uids(name).values())
        return status if counted and gone else None
    try:
        return wait_until(restarted, timeout, interval=0.5,
                          what=f"{name}: no {reason} restart #{count}")
    except TimeoutError as e:  # what it came to instead
        pods = [(p.metadata.name, p.status.phase) for p in mds.pods(name)]
        raise TimeoutError(f"{e}; status: {mds.status(name)}; pods: {pods}") from None

