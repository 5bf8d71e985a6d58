"""What the chart renders: standard labels, a non-root read-only operator with probes on its
health endpoint, and the values wired through (RBAC: test_rbac.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import shoal
from tests.support.helm import (CHART, CI_VALUES, IMAGE_REPOSITORY, NAMESPACE, RELEASE, find, only,
                                render, run_helm, values_args)

STANDARD_LABELS = {
    "app.kubernetes.io/name": "shoal",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/component": "operator",
    "app.kubernetes.io/version": shoal.__version__,
    "app.kubernetes.io/part-of": "shoal",
    "app.kubernetes.io/managed-by": "Helm",
    "helm.sh/chart": f"shoal-{shoal.__version__}",
}


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("values", [[], *([path] for path in CI_VALUES)],
                         ids=["default", *(path.stem for path in CI_VALUES)])
def test_every_object_has_the_standard_labels(values: list[Path]) -> None:
    objects = render(*values)
    deployment = only(objects, "Deployment")
    for obj in [*objects, deployment["spec"]["template"]]:
        labels = obj["metadata"]["labels"]
        assert {k: labels.get(k) for k in STANDARD_LABELS} == STANDARD_LABELS, obj["metadata"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == {k: STANDARD_LABELS[k] for k in (
        "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")}


def test_rbac_and_service_account_can_be_left_to_the_user() -> None:
    objects = render(set_values=["rbac.create=false", "serviceAccount.create=false",
                                 "serviceAccount.name=platform-operator"])
    assert sorted(o["kind"] for o in objects) == ["Deployment", "PodDisruptionBudget"]
    assert only(objects, "Deployment")["spec"]["template"]["spec"][
        "serviceAccountName"] == "platform-operator"
    refused = run_helm("template", RELEASE, CHART,
                       *values_args(set_values=["serviceAccount.create=false"]), check=False)
    assert refused.returncode != 0
    assert "serviceAccount.name is required" in refused.stderr


def test_operator_runs_non_root_read_only_with_probes_on_its_health_endpoint() -> None:
    objects = render()
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    container = _container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert "volumeMounts" not in container and "volumes" not in pod
    assert container["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"},
                                  {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["command"] == ["python", "-m", "shoal_operator"]
    assert "--health-port=8080" in container["args"]
    assert {"name": "SHOAL_OPERATOR_HEALTH_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]


def test_two_operators_elect_a_leader_watching_every_namespace_by_default() -> None:
    objects = render()
    spec = only(objects, "Deployment")["spec"]
    args = _container(objects)["args"]
    assert not [a for a in args if a.startswith("--namespace")]
    assert spec["replicas"] == 2 and "strategy" not in spec  # a rolling update
    assert {"--leader-election", f"--leader-election-namespace={NAMESPACE}",
            "--leader-election-id=shoal-operator"} <= set(args)
    budget = only(objects, "PodDisruptionBudget")["spec"]
    assert budget == {"maxUnavailable": 1, "selector": spec["selector"]}
    single = render(set_values=["operator.replicas=1"])
    assert only(single, "Deployment")["spec"]["replicas"] == 1
    assert not find(single, "PodDisruptionBudget")


def test_host_paths_are_refused_unless_allowed() -> None:
    assert "--allow-host-path" not in _container(render())["args"]
    assert "--allow-host-path" in _container(render(set_values=["operator.allowHostPath=true"]))[
        "args"]


def test_image_repository_is_required_with_how_to_build_one() -> None:
    refused = run_helm("template", RELEASE, CHART, check=False)
    assert refused.returncode != 0
    assert "image.repository is required: no registry publishes shoal's image" in refused.stderr
    assert "make image" in refused.stderr


def test_image_defaults_to_the_app_version_and_a_new_tag_moves_the_operator_alone() -> None:
    app_image = f"{IMAGE_REPOSITORY}:{shoal.__version__}"
    container = _container(render())
    assert container["image"] == app_image
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert f"--default-image={app_image}" in container["args"]
    container = _container(render(set_values=["image.tag=0.2.0"]))
    assert container["image"] == f"{IMAGE_REPOSITORY}:0.2.0"
    assert f"--default-image={app_image}" in container["args"]


def test_custom_image_values() -> None:
    objects = render(CHART / "ci" / "custom-image-values.yaml")
    container = _container(objects)
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    assert container["image"] == "registry.example.com/ml/shoal:0.1.0-cuda12.8"
    assert container["imagePullPolicy"] == "Always"
    assert "--default-image=registry.example.com/ml/shoal:0.1.0-cuda12.8-h100" in container["args"]
    assert "--log-level=debug" in container["args"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "shoal-controller"
    account = only(objects, "ServiceAccount")
    assert account["metadata"]["name"] == "shoal-controller"
    assert account["metadata"]["annotations"] == {"iam.example.com/role": "shoal-operator"}


def test_scheduling_resources_and_extras_are_passed_through() -> None:
    objects = render(set_values=[
        "nodeSelector.pool=system", "tolerations[0].key=dedicated",
        "tolerations[0].operator=Exists", "priorityClassName=system-cluster-critical",
        ("affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
         ".nodeSelectorTerms[0].matchExpressions[0].key=arch"),
        "resources.limits.cpu=2", "podAnnotations.team=ml", "podLabels.tier=control",
        "operator.extraArgs={--verbose}", "operator.extraEnv[0].name=TZ",
        "operator.extraEnv[0].value=UTC"])
    pod_template = only(objects, "Deployment")["spec"]["template"]
    pod, container = pod_template["spec"], _container(objects)
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["affinity"]["nodeAffinity"]
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"},
                                      "limits": {"cpu": 2, "memory": "512Mi"}}
    assert pod_template["metadata"]["annotations"] == {"team": "ml"}
    assert pod_template["metadata"]["labels"]["tier"] == "control"
    assert container["args"][-1] == "--verbose"
    assert {"name": "TZ", "value": "UTC"} in container["env"]


def test_names_follow_release_and_overrides() -> None:
    out = run_helm("template", "prod", CHART, *values_args()).stdout
    assert "name: prod-shoal-operator" in out
    out = run_helm("template", "prod", CHART,
                   *values_args(set_values=["fullnameOverride=llm"])).stdout
    assert "name: llm-operator" in out and "prod-shoal" not in out

