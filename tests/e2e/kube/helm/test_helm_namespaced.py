"""`helm install ... --set watchNamespaces={X}`: the operator runs on a Role in X alone (no
cluster-scoped permission at all), handles ModelDeployments in X and leaves other namespaces'
alone."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from tests.e2e.kube.helm.release import (
    SELF_REVIEWS,
    SERVICE_ACCOUNT,
    Release,
    delete_namespace,
    granted,
    helm_release,
)
from tests.support.kube.cluster import RunningCluster
from tests.support.wait import wait_until
from tests.support.helm import LEADER_ELECTION_PERMISSIONS, OPERATOR_PERMISSIONS

CREATED_S = 180.0  # the operator pod starts (kopf, the client) first: ~60 s on a loaded host
MD = ("shoal.dev", "v1alpha1", "modeldeployments")
# no engine pod to wait for: the test is about who handles it (status, Services, finalizer)
MODEL_DEPLOYMENT = {"apiVersion": "shoal.dev/v1alpha1", "kind": "ModelDeployment",
                    "metadata": {"name": "watched"}, "spec": {"replicas": 0}}


@pytest.fixture(scope="module")
def watched(running_cluster: RunningCluster) -> Iterator[str]:
    name = f"team-{uuid.uuid4().hex[:6]}"
    kubernetes.client.CoreV1Api(running_cluster.cluster.api_client()).create_namespace(
        {"metadata": {"name": name}})
    yield name
    delete_namespace(running_cluster, name)


@pytest.fixture(scope="module")
def namespaced(running_cluster: RunningCluster, watched: str) -> Iterator[Release]:
    with helm_release(running_cluster, "--set", f"watchNamespaces={{{watched}}}") as installed:
        yield installed


def _status(release: Release, namespace: str, name: str) -> dict[str, Any]:
    return release.custom.get_namespaced_custom_object(*MD[:2], namespace, MD[2],
                                                       name).get("status") or {}


def test_operator_holds_a_role_in_the_watched_namespace_only(namespaced: Release, watched: str,
                                                             namespace: str) -> None:
    rbac = kubernetes.client.RbacAuthorizationV1Api(namespaced.cluster.api_client())
    assert SERVICE_ACCOUNT not in {r.metadata.name for r in rbac.list_cluster_role().items}
    assert [r.metadata.name for r in rbac.list_namespaced_role(watched).items] == [
        SERVICE_ACCOUNT]
    operator = namespaced.operator_client()
    assert granted(operator, watched) - SELF_REVIEWS == OPERATOR_PERMISSIONS
    assert granted(operator, namespace) == SELF_REVIEWS
    assert granted(operator, namespaced.namespace) == SELF_REVIEWS | LEADER_ELECTION_PERMISSIONS
    assert not namespaced.allowed(None, verb="list", resource="namespaces")
    assert not namespaced.allowed(None, verb="list", group="apiextensions.k8s.io",
                                  resource="customresourcedefinitions")


def test_operator_handles_the_watched_namespace_and_no_other(namespaced: Release, watched: str,
                                                             namespace: str) -> None:
    for where in (watched, namespace):
        namespaced.custom.create_namespaced_custom_object(*MD[:2], where, MD[2],
                                                          MODEL_DEPLOYMENT)
    wait_until(lambda: _status(namespaced, watched, "watched").get("observedGeneration"),
               CREATED_S, what="the operator wrote no status in the watched namespace")
    assert {s.metadata.name for s in namespaced.core.list_namespaced_service(watched).items} == {
        "watched", "watched-nodes"}
    assert _status(namespaced, namespace, "watched") == {}
    assert not namespaced.core.list_namespaced_service(namespace).items
    assert "Forbidden" not in namespaced.operator_log()
    # a ModelDeployment the operator never handled has no finalizer: the namespace can go
    assert not namespaced.custom.get_namespaced_custom_object(
        *MD[:2], namespace, MD[2], "watched")["metadata"].get("finalizers")
    # the handled one is deleted while its operator runs: it takes its finalizer off
    namespaced.custom.delete_namespaced_custom_object(*MD[:2], watched, MD[2], "watched")
    wait_until(lambda: not namespaced.custom.list_namespaced_custom_object(
        *MD[:2], watched, MD[2])["items"], CREATED_S, what="ModelDeployment not deleted")
