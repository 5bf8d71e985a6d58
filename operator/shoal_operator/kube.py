"""The only module that talks to the Kubernetes API (the official client): read a
ModelDeployment and its children back, and carry out a plan's actions."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

import kubernetes
from kubernetes.client import (
    ApiClient,
    ApiException,
    AppsV1Api,
    CoordinationV1Api,
    CoreV1Api,
    CustomObjectsApi,
    NetworkingV1Api,
)

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
from shoal_operator.observed import EngineSignals, PodState

logger = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 2.0

NOT_FOUND, CONFLICT = 404, 409


def load_api_client() -> ApiClient:
    """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG or ~/.kube/config (as kopf does)."""
    try:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
    return ApiClient()


def _json(response: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(response.data)
    return data


def _body(obj: dict[str, Any]) -> Any:
    """A plain dict as a request body: the client serializes it as it is (its signatures name
    the model classes)."""
    return obj


class Kube:
    def __init__(self, api_client: ApiClient) -> None:
        self.core = CoreV1Api(api_client)
        self.apps = AppsV1Api(api_client)
        self.custom = CustomObjectsApi(api_client)
        self.networking = NetworkingV1Api(api_client)
        self.coordination = CoordinationV1Api(api_client)

    def read_model_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return _json(self.custom.get_namespaced_custom_object(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name,
                _preload_content=False))
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return None
            raise

    def list_children(self, namespace: str, name: str) -> tuple[
            list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]],
            list[dict[str, Any]]]:
        """The pods, Services, Deployments and NetworkPolicies carrying the ModelDeployment's
        instance label."""
        selector = f"{names.INSTANCE}={name},{names.MANAGED_BY}={names.OPERATOR}"
        pods = _json(self.core.list_namespaced_pod(namespace, label_selector=selector,
                                                   _preload_content=False))
        services = _json(self.core.list_namespaced_service(namespace, label_selector=selector,
                                                           _preload_content=False))
        deployments = _json(self.apps.list_namespaced_deployment(
            namespace, label_selector=selector, _preload_content=False))
        policies = _json(self.networking.list_namespaced_network_policy(
            namespace, label_selector=selector, _preload_content=False))
        return pods["items"], services["items"], deployments["items"], policies["items"]

    def read_lease(self, namespace: str, name: str, timeout_s: float) -> dict[str, Any] | None:
        try:
            return _json(self.coordination.read_namespaced_lease(
                name, namespace, _preload_content=False, _request_timeout=timeout_s))
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return None
            raise

    def write_lease(self, namespace: str, name: str, spec: dict[str, Any],
                    resource_version: str | None, timeout_s: float) -> None:
        """Create the Lease (no resource_version) or replace it at that version: 409 when
        another replica wrote it first. A call gives up after `timeout_s`."""
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
                "spec": spec}
        if resource_version is None:
            self.coordination.create_namespaced_lease(namespace, _body(body),
                                                   _request_timeout=timeout_s)
        else:
            metadata["resourceVersion"] = resource_version
            self.coordination.replace_namespaced_lease(name, namespace, _body(body),
                                                    _request_timeout=timeout_s)

    def read_signals(self, pods: Iterable[PodState]) -> dict[str, EngineSignals]:
        """Each pod's engine /metrics (Prometheus text), by its group; a pod that does not
        answer is left out (its group's signal is then not counted)."""
        found = {}
        for pod in pods:
            url = f"http://{pod.pod_ip}:{names.HTTP_PORT}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as response:
                    found[pod.group] = EngineSignals.from_metrics(response.read().decode())
            except (OSError, ValueError) as exc:  # URLError and timeouts are OSErrors
                logger.warning("no signals from %s (%s): %s", pod.name, url, exc)
        return found

    def apply(self, md_body: dict[str, Any], action: Action) -> None:
        """Carry out one action. Creating what exists and deleting what is gone are no-ops; a
        status write conflicts (409) when the ModelDeployment changed since it was read."""
        namespace = md_body["metadata"]["namespace"]
        if isinstance(action, ReplaceStatus):
            self.custom.replace_namespaced_custom_object_status(
                names.GROUP, names.VERSION, namespace, names.PLURAL,
                md_body["metadata"]["name"], {**md_body, "status": action.status})
        elif isinstance(action, ScaleRole):
            name = md_body["metadata"]["name"]
            if action.role == names.ENGINE_ROLE:
                self.custom.patch_namespaced_custom_object_scale(
                    names.GROUP, names.VERSION, namespace, names.PLURAL, name,
                    {"spec": {"replicas": action.replicas}},
                    _content_type="application/merge-patch+json")
            else:
                self.custom.patch_namespaced_custom_object(
                    names.GROUP, names.VERSION, namespace, names.PLURAL, name,
                    {"spec": {"disaggregation": {action.role: {"replicas": action.replicas}}}},
                    _content_type="application/merge-patch+json")
        elif isinstance(action, EmitEvent):
            _create(lambda: self.core.create_namespaced_event(namespace, _body(action.event)))
        elif isinstance(action, CreateService):
            _create(lambda: self.core.create_namespaced_service(namespace, _body(action.service)))
        elif isinstance(action, CreateDeployment):
            _create(lambda: self.apps.create_namespaced_deployment(
                namespace, _body(action.deployment)))
        elif isinstance(action, PatchDeployment):
            self.apps.patch_namespaced_deployment(  # lists are replaced whole
                action.deployment["metadata"]["name"], namespace, action.deployment,
                _content_type="application/merge-patch+json")
        elif isinstance(action, DeleteRouter):
            _delete(lambda: self.apps.delete_namespaced_deployment(action.name, namespace))
            _delete(lambda: self.core.delete_namespaced_service(action.name, namespace))
        elif isinstance(action, ApplyNetworkPolicy):
            if action.exists:
                self.networking.patch_namespaced_network_policy(
                    action.policy["metadata"]["name"], namespace, action.policy,
                    _content_type="application/merge-patch+json")
            else:
                _create(lambda: self.networking.create_namespaced_network_policy(
                    namespace, _body(action.policy)))
        elif isinstance(action, DeleteNetworkPolicy):
            _delete(lambda: self.networking.delete_namespaced_network_policy(action.name,
                                                                            namespace))
        elif isinstance(action, CreatePods):
            for pod in action.pods:
                _create(lambda pod=pod: self.core.create_namespaced_pod(namespace, pod))
        elif isinstance(action, DeletePods):
            for ref in action.pods:
                logger.info("deleting pod %s/%s: %s", namespace, ref.name, action.why)
                try:
                    self.core.delete_namespaced_pod(
                        ref.name, namespace, grace_period_seconds=action.grace_seconds,
                        body=_body({"preconditions": {"uid": ref.uid}}))
                except ApiException as exc:
                    if exc.status not in (NOT_FOUND, CONFLICT):  # gone, or a newer pod
                        raise


def _delete(call: Any) -> None:
    try:
        call()
    except ApiException as exc:
        if exc.status != NOT_FOUND:
            raise


def _create(call: Any) -> None:
    try:
        call()
    except ApiException as exc:
        if exc.status != CONFLICT:
            raise
