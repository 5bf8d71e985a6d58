"""Applying YAML manifests as `kubectl apply --server-side --force-conflicts` does: the object
is created, or updated to what the manifest says (fields this manager set before and the
manifest no longer has are removed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from tests.support.wait import wait_until

DISCOVERY_TIMEOUT_S = 30.0
FIELD_MANAGER = "shoal-tests"


def load_manifests(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def apply_manifest(client: DynamicClient, manifest: dict[str, Any],
                   namespace: str | None = None) -> dict[str, Any]:
    """Apply `manifest`; the object as stored.

    A kind that discovery does not know yet (a CRD applied a moment ago) is waited for; an
    applied CRD is waited for until it is Established."""
    resource = _resource(client, manifest["apiVersion"], manifest["kind"])
    if resource.namespaced:
        namespace = manifest.get("metadata", {}).get("namespace") or namespace or "default"
    else:
        namespace = None
    stored = client.server_side_apply(resource, body=manifest, namespace=namespace,
                                      field_manager=FIELD_MANAGER,
                                      force_conflicts=True).to_dict()
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

    wait_until(established, DISCOVERY_TIMEOUT_S, what=f"CRD {crd_name} not Established")


def _resource(client: DynamicClient, api_version: str, kind: str) -> Any:
    def found() -> Any:
        try:
            return client.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            client.resources.invalidate_cache()
            return None

    return wait_until(found, DISCOVERY_TIMEOUT_S,
                      what=f"the API serves no {kind} in {api_version}")
