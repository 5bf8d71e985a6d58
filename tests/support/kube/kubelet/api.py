"""The process kubelet's one door to the API server (plain dicts in, plain dicts out)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError

MERGE_PATCH = "application/merge-patch+json"
TOKEN_SECONDS = 3600
KINDS = ("Pod", "Node", "ConfigMap", "Secret", "PersistentVolumeClaim", "PersistentVolume",
         "ServiceAccount", "Event")


class KubeApi:
    def __init__(self, kubeconfig: Path, discovery_cache: Path) -> None:
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.discovery = kubernetes.client.DiscoveryV1Api(self.client)
        dynamic = DynamicClient(self.client, cache_file=str(discovery_cache))
        self._dynamic = dynamic
        self._resources = {kind: dynamic.resources.get(api_version="v1", kind=kind)
                           for kind in KINDS}

    @property
    def apiserver_port(self) -> int:
        port = urlparse(self.client.configuration.host).port
        assert port is not None
        return port

    def to_dict(self, model: Any) -> dict[str, Any]:
        """A typed client model (what the informers hold) as the API's JSON."""
        return self.client.sanitize_for_serialization(model)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._resources[kind].get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def bind(self, pod: dict[str, Any], node_name: str) -> None:
        meta = pod["metadata"]
        self._resources["Pod"].binding.create(
            namespace=meta["namespace"], name=meta["name"],
            body={"apiVersion": "v1", "kind": "Binding",
                  "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta["uid"]},
                  "target": {"apiVersion": "v1", "kind": "Node", "name": node_name}})

    def patch_pod_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self._resources["Pod"].status.patch(
            namespace=meta["namespace"], name=meta["name"], content_type=MERGE_PATCH,
            body={"metadata": {"uid": meta["uid"]}, "status": status})

    def delete_pod_now(self, pod: dict[str, Any]) -> None:
        """What a kubelet does once a pod's containers are gone: delete it with grace 0."""
        meta = pod["metadata"]
        with contextlib.suppress(NotFoundError, ConflictError):  # gone, or a new pod's name
            self._resources["Pod"].delete(
                namespace=meta["namespace"], name=meta["name"],
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})

    def request_token(self, pod: dict[str, Any], service_account: str, audience: str | None,
                      seconds: int | None) -> str:
        """A ServiceAccount token bound to `pod`, from the TokenRequest API."""
        meta = pod["metadata"]
        spec: dict[str, Any] = {
            "expirationSeconds": seconds or TOKEN_SECONDS,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "uid": meta["uid"]}}
        if audience:
            spec["audiences"] = [audience]
        response = self._resources["ServiceAccount"].token.create(
            namespace=meta["namespace"], name=service_account,
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                  "spec": spec})
        return response.status.token

    def register_node(self, node: dict[str, Any]) -> None:
        """Create (or take over) the Node, then set its status."""
        nodes = self._resources["Node"]
        name = node["metadata"]["name"]
        try:
            nodes.create(body=node)
        except ConflictError:
            current = nodes.get(name=name)
            nodes.replace(body={**node, "metadata": {
                **node["metadata"], "resourceVersion": current.metadata.resourceVersion}})
        nodes.status.patch(name=name, body={"status": node["status"]}, content_type=MERGE_PATCH)

    def record_event(self, pod: dict[str, Any], reason: str, message: str, event_type: str,
                     component: str, time: str) -> None:
        meta = pod["metadata"]
        self._resources["Event"].create(namespace=meta["namespace"], body={
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "reason": reason, "message": message, "type": event_type,
            "source": {"component": component}, "firstTimestamp": time, "lastTimestamp": time,
            "count": 1})
