"""`helm install shoal helm/shoal` into the real test cluster: the operator runs in a pod with the
chart's ServiceAccount token and exactly the chart's permissions, serves the example tp=2
ModelDeployment, is replaced by `helm upgrade` without touching the engine, and `helm uninstall`
leaves the CRD and the user's resources alone. The last test uninstalls: keep it last."""

from __future__ import annotations

from typing import Any

import httpx
import kubernetes
import pytest

from tests.e2e.kube.helm.release import (
    RESTRICTED_LABELS,
    SELF_REVIEWS,
    SERVICE_ACCOUNT,
    TOKEN_DIR,
    Release,
    chat,
    granted,
    service_url,
    token_subject,
)
from tests.support.kube.binaries import REPO
from tests.support.wait import wait_until
from tests.support.helm import (
    CHART,
    LEADER_ELECTION_PERMISSIONS,
    OPERATOR_PERMISSIONS,
    RELEASE,
)

EXAMPLE = REPO / "examples" / "colocated-tp2.yaml"
EXAMPLE_NAME = "smollm-tp2"
READY_S = 420.0  # two ranks load the default model on two shared cores
UPGRADE_TAG = "0.1.0-operator-fix"
MD = ("shoal.dev", "v1alpha1")


def _model_deployment(release: Release, namespace: str) -> dict[str, Any]:
    return release.custom.get_namespaced_custom_object(*MD, namespace, "modeldeployments",
                                                       EXAMPLE_NAME)


def _engine_pods(release: Release, namespace: str) -> dict[str, str]:
    """name -> uid of the example's engine pods."""
    pods = release.core.list_namespaced_pod(
        namespace, label_selector=f"app.kubernetes.io/instance={EXAMPLE_NAME}").items
    return {pod.metadata.name: pod.metadata.uid for pod in pods}


def _engine_pids(release: Release, namespace: str, pods: dict[str, str]) -> set[int]:
    return {p.pid for name in pods for p in release.kubelet.pod_processes(namespace, name)}


def _assert_chat(release: Release, namespace: str, url: str) -> None:
    """A chat completion through the Service endpoint is 200 (else: the engine's log)."""
    try:
        status = chat(url).status_code
    except httpx.HTTPError as exc:
        status = repr(exc)
    logs = "".join(release.kubelet.pod_log(namespace, name)[-4000:]
                   for name in _engine_pods(release, namespace))
    assert status == 200, f"chat at {url}: {status}; engine log:\n{logs}"


def test_install_prints_what_to_apply_next(release: Release) -> None:
    assert f"kubectl -n {release.namespace} rollout status deployment/shoal-operator" in \
        release.install_output
    assert "kubectl apply -f examples/colocated-tp2.yaml" in release.install_output


def test_operator_runs_with_the_charts_service_account_token(release: Release) -> None:
    pod = release.ready_operator_pod()
    assert pod.spec.service_account_name == SERVICE_ACCOUNT
    env = release.operator_process(pod.metadata.name).environ()
    assert env["KUBERNETES_SERVICE_HOST"] and env["KUBERNETES_SERVICE_PORT"]
    assert "KUBECONFIG" not in env
    assert env["SHOAL_OPERATOR_HEALTH_HOST"] == pod.status.pod_ip
    assert release.operator_file(pod.metadata.name, f"{TOKEN_DIR}/namespace") == release.namespace
    assert "BEGIN CERTIFICATE" in release.operator_file(pod.metadata.name, f"{TOKEN_DIR}/ca.crt")
    token = release.operator_file(pod.metadata.name, f"{TOKEN_DIR}/token")
    assert token_subject(token) == release.user
    authentication = kubernetes.client.AuthenticationV1Api(release.cluster.api_client())
    review = authentication.create_token_review({"spec": {"token": token}})
    assert review.status.authenticated and review.status.user.username == release.user


def test_service_account_may_do_exactly_what_the_operator_needs(release: Release,
                                                               namespace: str) -> None:
    operator = release.operator_client()
    assert granted(operator, namespace) - SELF_REVIEWS == OPERATOR_PERMISSIONS
    assert granted(operator, release.namespace) - SELF_REVIEWS == \
        OPERATOR_PERMISSIONS | LEADER_ELECTION_PERMISSIONS
    for where in (namespace, release.namespace, None):
        for verb in ("get", "list", "watch"):
            assert not release.allowed(where, verb=verb, resource="secrets")
    assert not release.allowed(namespace, verb="create", resource="pods", subresource="exec")
    assert not release.allowed(namespace, verb="delete", group="shoal.dev",
                               resource="modeldeployments")
    with pytest.raises(kubernetes.client.ApiException) as refused:
        kubernetes.client.CoreV1Api(operator).list_namespaced_secret(namespace)
    assert refused.value.status == 403


def test_two_operators_run_restricted_and_one_leads(release: Release) -> None:
    """Both pods of the chart's default passed the release namespace's `restricted` Pod
    Security profile; one holds the Lease."""
    labels = release.core.read_namespace(release.namespace).metadata.labels
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    pods = release.operator_pods()
    assert len(pods) == 2 and all(p.status.phase == "Running" for p in pods)
    leader = release.ready_operator_pod()
    assert "leading as" in release.kubelet.pod_log(release.namespace, leader.metadata.name)
    (standby,) = [p for p in pods if p.metadata.uid != leader.metadata.uid]
    assert "leading as" not in release.kubelet.pod_log(release.namespace, standby.metadata.name)


def test_example_serves_through_upgrade_and_uninstall(release: Release, namespace: str) -> None:
    # a user applies the example as it is, in a namespace that enforces `restricted`
    release.core.patch_namespace(namespace, {"metadata": {"labels": RESTRICTED_LABELS}})
    release.cluster.apply_file(EXAMPLE, namespace)
    md = wait_until(lambda: (lambda md: md if md.get("status", {}).get("phase") == "Ready"
                             else None)(_model_deployment(release, namespace)),
                    READY_S, interval=1.0, what=f"{EXAMPLE_NAME} not Ready")
    url = service_url(release.core, namespace, md["status"]["endpoint"])
    _assert_chat(release, namespace, url)
    engine = _engine_pods(release, namespace)
    pids = _engine_pids(release, namespace, engine)
    assert engine and pids

    # helm upgrade with a new operator image tag: a new operator pod, the engine untouched
    old = release.ready_operator_pod()
    release.helm("upgrade", RELEASE, CHART, "--reuse-values", "--set", f"image.tag={UPGRADE_TAG}",
                 "--wait", "--timeout", "180s")
    new = release.ready_operator_pod(image_tag=UPGRADE_TAG)
    assert new.metadata.uid != old.metadata.uid
    assert new.spec.containers[0].image.endswith(f":{UPGRADE_TAG}")
    # a spec change outside the pod template: the new operator's pass records it in the status
    generation = release.custom.patch_namespaced_custom_object(
        *MD, namespace, "modeldeployments", EXAMPLE_NAME,
        {"spec": {"restartPolicy": {"maxGroupRestarts": 11}}})["metadata"]["generation"]
    wait_until(lambda: _model_deployment(release, namespace)["status"].get(
        "observedGeneration") == generation, 60, what="the new operator made no pass")
    assert _engine_pods(release, namespace) == engine
    assert _engine_pids(release, namespace, engine) == pids
    assert _model_deployment(release, namespace)["status"]["phase"] == "Ready"
    _assert_chat(release, namespace, url)
    logs = release.operator_log() + release.kubelet.pod_log(release.namespace, old.metadata.name)
    assert "Forbidden" not in logs

    # helm uninstall: operator and RBAC gone; CRD, ModelDeployment and engine stay
    release.helm("uninstall", RELEASE, "--wait", "--timeout", "120s")
    wait_until(lambda: not release.operator_pods(), 60, what="operator pod still there")
    rbac = kubernetes.client.RbacAuthorizationV1Api(release.cluster.api_client())
    assert SERVICE_ACCOUNT not in {r.metadata.name for r in rbac.list_cluster_role().items}
    assert SERVICE_ACCOUNT not in {b.metadata.name for b in rbac.list_cluster_role_binding().items}
    assert SERVICE_ACCOUNT not in {
        a.metadata.name for a in release.core.list_namespaced_service_account(
            release.namespace).items}
    extensions = kubernetes.client.ApiextensionsV1Api(release.cluster.api_client())
    assert extensions.read_custom_resource_definition("modeldeployments.shoal.dev")
    assert _model_deployment(release, namespace)["status"]["phase"] == "Ready"
    assert _engine_pods(release, namespace) == engine
    assert _engine_pids(release, namespace, engine) == pids
    _assert_chat(release, namespace, url)

    # without its operator, a ModelDeployment keeps the operator's finalizer: take it off as
    # docs/kubernetes.md says, so the namespace can go
    release.custom.patch_namespaced_custom_object(*MD, namespace, "modeldeployments",
                                                  EXAMPLE_NAME, {"metadata": {"finalizers": None}})
