"""The chart installed into the test cluster with helm, as a user installs it, and what the
tests look at: the operator's pod, process, token and permissions, a Service's endpoint.

    with helm_release(running_cluster, "--set", "watchNamespaces={team-a}") as release:
        ...                      # `helm install --wait` done: the operator pod is Ready
"""

from __future__ import annotations

import base64
import json
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import psutil

from tests.support.kube.cluster import KubeCluster, RunningCluster
from tests.support.kube.kubelet_handle import KubeletHandle
from tests.support.wait import wait_until
from tests.support.helm import CHART, IMAGE_VALUES, RELEASE, run_helm

HELM_WAIT = "180s"
LEADER_S = 60.0  # a new leader within the Lease's duration and two retries, on a loaded host
# a namespace that enforces the `restricted` Pod Security profile
RESTRICTED_LABELS = {f"pod-security.kubernetes.io/{mode}": "restricted"
                     for mode in ("enforce", "warn", "audit")}
GONE_S = 120.0
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_ACCOUNT = "shoal-operator"
OPERATOR_SELECTOR = (f"app.kubernetes.io/instance={RELEASE},"
                     "app.kubernetes.io/component=operator")
# what every authenticated user may do (system:basic-user): ask what it may do
SELF_REVIEWS = frozenset([("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
                          ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
                          ("authentication.k8s.io", "selfsubjectreviews", "create")])


@dataclass
class Release:
    namespace: str
    cluster: KubeCluster
    kubelet: KubeletHandle
    install_output: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{SERVICE_ACCOUNT}"

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.cluster.api_client())

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.cluster.api_client())

    def helm(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        return run_helm(*args, "--namespace", self.namespace,
                        kubeconfig=self.cluster.admin_kubeconfig)

    def operator_pods(self) -> list[Any]:
        return self.core.list_namespaced_pod(self.namespace,
                                             label_selector=OPERATOR_SELECTOR).items

    def ready_operator_pod(self, image_tag: str | None = None) -> Any:
        """The leading operator pod (its name begins the Lease's holder identity), Ready and
        not on its way out; with `image_tag`, one running that tag."""
        coordination = kubernetes.client.CoordinationV1Api(self.cluster.api_client())

        def leader() -> Any:
            try:
                holder = coordination.read_namespaced_lease(
                    SERVICE_ACCOUNT, self.namespace).spec.holder_identity or ""
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            return next((pod for pod in self.operator_pods()
                         if holder.startswith(f"{pod.metadata.name}_")
                         and not pod.metadata.deletion_timestamp
                         and any(c.type == "Ready" and c.status == "True"
                                 for c in pod.status.conditions or [])
                         and (image_tag is None
                              or pod.spec.containers[0].image.endswith(f":{image_tag}"))),
                        None)
        return wait_until(leader, LEADER_S, interval=0.5, what="no Ready leading operator pod")

    def operator_process(self, pod_name: str) -> psutil.Process:
        """The operator's python process (PID 1 of its container)."""
        found = [p for p in self.kubelet.pod_processes(self.namespace, pod_name)
                 if "shoal_operator" in p.cmdline()]
        assert len(found) == 1, found
        return found[0]

    def operator_file(self, pod_name: str, path: str) -> str:
        """A file as the operator's container sees it (in its mount namespace)."""
        return subprocess.run(["nsenter", f"--target={self.operator_process(pod_name).pid}",
                               "--mount", "cat", path], check=True, capture_output=True,
                              text=True).stdout

    def operator_client(self) -> kubernetes.client.ApiClient:
        """A client with the token the kubelet mounted into the operator's container."""
        pod = self.ready_operator_pod()
        token = self.operator_file(pod.metadata.name, f"{TOKEN_DIR}/token")
        kubeconfig = self.cluster.kubeconfig_for_token(
            token, self.cluster.state_dir / f"operator-{self.namespace}.kubeconfig")
        return kubernetes.config.new_client_from_config(config_file=str(kubeconfig))

    def operator_log(self) -> str:
        """Every operator pod's log (those still listed)."""
        return "".join(self.kubelet.pod_log(self.namespace, pod.metadata.name)
                       for pod in self.operator_pods())

    def allowed(self, namespace: str | None, **attributes: str) -> bool:
        """SubjectAccessReview: may the operator's ServiceAccount do this?"""
        review = kubernetes.client.AuthorizationV1Api(
            self.cluster.api_client()).create_subject_access_review(
            {"spec": {"user": self.user,
                      "groups": ["system:serviceaccounts", "system:authenticated",
                                 f"system:serviceaccounts:{self.namespace}"],
                      "resourceAttributes": {"namespace": namespace, **attributes}}})
        return bool(review.status.allowed)


@contextmanager
def helm_release(running: RunningCluster, *helm_args: str,
                 labels: dict[str, str] | None = None) -> Iterator[Release]:
    """`helm install shoal helm/shoal --wait` into a new namespace (with `labels`, if given);
    afterwards uninstalled (if the test did not) and the namespace deleted."""
    namespace = f"shoal-system-{uuid.uuid4().hex[:6]}"
    cluster = running.cluster
    kubernetes.client.CoreV1Api(cluster.api_client()).create_namespace(
        {"metadata": {"name": namespace, "labels": labels or {}}})
    installed = run_helm("install", RELEASE, CHART, "--namespace", namespace, "--wait",
                         "--timeout", HELM_WAIT, "--values", IMAGE_VALUES, *helm_args,
                         kubeconfig=cluster.admin_kubeconfig, check=False)
    try:
        assert installed.returncode == 0, \
            f"helm install failed:\n{installed.stderr}\n{_operator_report(running, namespace)}"
        yield Release(namespace=namespace, cluster=cluster, kubelet=running.kubelet,
                      install_output=installed.stdout)
    finally:
        run_helm("uninstall", RELEASE, "--namespace", namespace, "--ignore-not-found", "--wait",
                 kubeconfig=cluster.admin_kubeconfig)
        delete_namespace(running, namespace)


def _operator_report(running: RunningCluster, namespace: str) -> str:
    """The operator pods' container states and the tail of their logs."""
    core = kubernetes.client.CoreV1Api(running.cluster.api_client())
    lines = []
    for pod in core.list_namespaced_pod(namespace, label_selector=OPERATOR_SELECTOR).items:
        lines.append(f"pod {pod.metadata.name}: {pod.status.phase}, "
                     f"containers {pod.status.container_statuses}")
        lines.append(running.kubelet.pod_log(namespace, pod.metadata.name)[-3000:])
    return "\n".join(lines)


def delete_namespace(running: RunningCluster, name: str) -> None:
    """Delete it and wait until it and its pods' processes are gone."""
    core = kubernetes.client.CoreV1Api(running.cluster.api_client())
    core.delete_namespace(name)
    wait_until(lambda: not any(ns.metadata.name == name for ns in core.list_namespace().items),
               GONE_S, what=f"namespace {name} still there")
    wait_until(lambda: not running.kubelet.namespace_processes(name), GONE_S,
               what=f"processes of {name}'s pods still running")


def granted(client: kubernetes.client.ApiClient, namespace: str) -> set[tuple[str, str, str]]:
    """SelfSubjectRulesReview: (apiGroup, resource, verb) the client's user holds there."""
    review = kubernetes.client.AuthorizationV1Api(client).create_self_subject_rules_review(
        {"spec": {"namespace": namespace}})
    return {(group, resource, verb) for rule in review.status.resource_rules
            for group in rule.api_groups for resource in rule.resources for verb in rule.verbs}


def token_subject(token: str) -> str:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["sub"]


def service_url(core: kubernetes.client.CoreV1Api, namespace: str, endpoint: str) -> str:
    """`status.endpoint` (<service>.<namespace>.svc.<domain>:<port>) resolved as kube-proxy
    would: the Service's selector, a Ready pod behind it, the container port its targetPort
    names. (The test cluster has no kube-proxy and no cluster DNS on the host.)"""
    host, port = endpoint.rsplit(":", 1)
    name, service_namespace = host.split(".")[:2]
    assert service_namespace == namespace, endpoint
    service = core.read_namespaced_service(name, namespace)
    (service_port,) = [p for p in service.spec.ports if p.port == int(port)]
    selector = ",".join(f"{k}={v}" for k, v in service.spec.selector.items())
    ready = [pod for pod in core.list_namespaced_pod(namespace, label_selector=selector).items
             if any(c.type == "Ready" and c.status == "True"
                    for c in pod.status.conditions or [])]
    assert ready, f"no Ready pod behind Service {name}"
    target = service_port.target_port
    if isinstance(target, str):
        (target,) = [p.container_port for c in ready[0].spec.containers for p in c.ports or []
                     if p.name == target]
    return f"http://{ready[0].status.pod_ip}:{target}"


def chat(base_url: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0})
