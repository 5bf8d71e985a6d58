"""Create-or-replace of YAML manifests, as `kubectl apply` does for a whole object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, ResourceNotFoundError

from tests.support.kube.waiting import wait_until

DISCOVERY_TIMEOUT_S = 30.0


def load_manifests(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def apply_manifest(client: DynamicClient, manifest: dict[str, Any],
                   namespace: str | None = None) -> dict[str, Any]:
    """Create `manifest`, or replace the object of that name with it; the object as stored.

    A kind that discovery does not know yet (a CRD applied a moment ago) is waited for; an
    applied CRD is waited for until it is Established."""
    resource = _resource(client, manifest["apiVersion"], manifest["kind"])
    if resource.namespaced:
        namespace = manifest.get("metadata", {}).get("namespace") or namespace or "default"
    else:
        namespace = None
    try:
        stored = client.create(resource, body=manifest, namespace=namespace).to_dict()
    except ConflictError:
        name = manifest["metadata"]["name"]
        current = client.get(resource, name=name, namespace=namespace)
        body = {**manifest, "metadata": {**manifest["metadata"],
                                         "resourceVersion": current.metadata.resourceVersion}}
        stored = client.replace(resource, body=body, namespace=namespace).to_dict()
    if manifest["kind"] == "CustomResourceDefinition":
        wait_established(client, stored["metadata"]["name"])
    return stored


def wait_established(client: DynamicClient, crd_name: str) -> None:
    crds = client.resources.get(api_version="apiextensions.k8s.io/v1",
                                kind="CustomResourceDefinition")

    def established() -> bool:
        conditions = client.get(crds, name=crd_name).to_dict().get("status", {}).get(
            "conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_until(established, DISCOVERY_TIMEOUT_S, message=f"CRD {crd_name} not Established")


def _resource(client: DynamicClient, api_version: str, kind: str) -> Any:
    def found() -> Any:
        try:
            return client.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            client.resources.invalidate_cache()
            return None

    return wait_until(found, DISCOVERY_TIMEOUT_S,
                      message=f"the API serves no {kind} in {api_version}")
