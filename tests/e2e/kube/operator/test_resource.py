"""The resource in the real apiserver. Acceptance 6: invalid ModelDeployments are refused by the
CRD's schema alone, with a message that names the field. Defaults are filled in; the scale
subresource (`kubectl scale`) and the printer columns work."""

from __future__ import annotations

import json
import ssl
from typing import Any

import httpx
import kubernetes
import pytest
import yaml

from tests.e2e.kube.operator.conftest import GROUP, PLURAL, VERSION, Deployments
from tests.support.kube.cluster import KubeCluster
from tests.support.wait import wait_until

INVALID = [
    ({"engine": {"tp": 0}}, "spec.engine.tp"),
    ({"replicas": -1}, "spec.replicas"),
    ({"restartPolicy": {"recreateGroupOn": ["watchdog", "sunspots"]}},
     "spec.restartPolicy.recreateGroupOn[1]"),
    ({"restartPolicy": {"recreateGroupOn": ["startup-failed"]}},
     "spec.restartPolicy.recreateGroupOn[0]"),
    ({"engine": {"nnodes": 0}}, "spec.engine.nnodes"),
    ({"engine": {"tp": 3, "nnodes": 2}}, "spec.engine"),
    ({"restartPolicy": {"maxGroupRestarts": -1}}, "spec.restartPolicy.maxGroupRestarts"),
    ({"restartPolicy": {"backoff": {"initialSeconds": 60, "maxSeconds": 10}}},
     "spec.restartPolicy.backoff"),
    ({"rollout": {"maxUnavailable": 0, "maxSurge": 0}}, "spec.rollout"),
    ({"router": {"policy": "fastest"}}, "spec.router.policy"),
    ({"model": {"volume": {}}}, "spec.model.volume"),
    ({"engine": {"tp": "two"}}, "spec.engine.tp"),
    ({"autoscaling": {"target": 2}}, "spec.autoscaling.maxReplicas"),
    ({"autoscaling": {"maxReplicas": 2, "target": 0}}, "spec.autoscaling"),
    ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": 1}}, "spec.autoscaling"),
    ({"autoscaling": {"maxReplicas": 2, "target": 1, "metric": "cpu"}},
     "spec.autoscaling.metric"),
    ({"autoscaling": {"maxReplicas": 2, "target": 1},
      "disaggregation": {"prefill": {}, "decode": {}}}, "spec"),
    ({"disaggregation": {"prefill": {"autoscaling": {"maxReplicas": 2, "target": 1,
                                                     "metric": "kvCacheUsage"}}}},
     "spec.disaggregation"),
    ({"disaggregation": {"decode": {"autoscaling": {"maxReplicas": 2, "target": 1,
                                                    "metric": "queuedRequests"}}}},
     "spec.disaggregation"),
]


def _refusal(mds: Deployments, name: str, spec: dict[str, Any]) -> str:
    with pytest.raises(kubernetes.client.ApiException) as refused:
        mds.create(name, spec)
    assert refused.value.status == 422
    return json.loads(refused.value.body)["message"]


@pytest.mark.parametrize("spec,field", INVALID, ids=[f for _, f in INVALID])
def test_an_invalid_spec_is_refused_naming_the_field(deployments: Deployments,
                                                     spec: dict[str, Any], field: str) -> None:
    message = _refusal(deployments, "bad", spec)
    assert f"{field}:" in message, message
    assert not deployments.exists("bad")


@pytest.mark.parametrize("name", ["has.dot", "9starts-with-digit", "x" * 46])
def test_a_name_that_cannot_be_a_hostname_is_refused(deployments: Deployments,
                                                     name: str) -> None:
    assert "metadata.name" in _refusal(deployments, name, {})


def test_defaults_are_filled_in(deployments: Deployments) -> None:
    spec = deployments.create("dflt", {"replicas": 0, "restartPolicy": {}})["spec"]
    assert spec["engine"] == {"tp": 1, "pp": 1, "nnodes": 1, "accelerator": "cpu"}
    assert spec["restartPolicy"] == {
        "recreateGroupOn": ["watchdog", "consensus", "peer-lost", "crash", "oom"],
        "maxGroupRestarts": 10, "backoff": {"initialSeconds": 10, "maxSeconds": 300}}
    assert spec["rollout"] == {"maxUnavailable": 1, "maxSurge": 0}


def test_kubectl_scale_and_the_printer_columns(deployments: Deployments,
                                               kube_cluster: KubeCluster) -> None:
    """The scale subresource (what `kubectl scale` uses) and the columns of `kubectl get md`.
    Pods that fail at once (a bad flag: 88) keep it quick: no model is loaded."""
    mds = deployments
    mds.create("scaled", {"replicas": 2, "engine": {"args": ["--no-such-flag"]}})
    wait_until(lambda: [g["phase"] for g in mds.status("scaled").get("groups", [])] == [
        "Failed", "Failed"], 120, interval=0.5, what="groups not Failed")
    mds.custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, mds.namespace, PLURAL, "scaled", {"spec": {"replicas": 1}})
    assert mds.get("scaled")["spec"]["replicas"] == 1
    # group 1 goes; group 0 tries again (a new generation) and fails again
    wait_until(lambda: [(g["name"], g["phase"]) for g in mds.status("scaled")["groups"]] == [
        ("scaled-0", "Failed")] and {p.metadata.name for p in mds.pods("scaled")} == {
        "scaled-0-0"}, 120, interval=0.5, what="group scaled-1 not removed")
    scale = mds.custom.get_namespaced_custom_object_scale(GROUP, VERSION, mds.namespace,
                                                          PLURAL, "scaled")
    assert scale["spec"]["replicas"] == 1
    selector = scale["status"]["selector"]
    assert "app.kubernetes.io/instance=scaled" in selector and "shoal.dev/node-rank=0" in selector
    assert [p.metadata.name for p in mds.core.list_namespaced_pod(
        mds.namespace, label_selector=selector).items] == ["scaled-0-0"]

    token = yaml.safe_load(kube_cluster.admin_kubeconfig.read_text())["users"][0]["user"]["token"]
    table = httpx.get(
        f"{kube_cluster.server}/apis/{GROUP}/{VERSION}/namespaces/{mds.namespace}/{PLURAL}",
        headers={"Authorization": f"Bearer {token}",
                 "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        verify=ssl.create_default_context(cafile=str(kube_cluster.ca_file))).json()
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns[:5] == ["Name", "Replicas", "Ready", "Phase", "Restarts"]
    assert "Age" in columns
    (row,) = table["rows"]
    assert row["cells"][:5] == ["scaled", 1, 0, "Failed", 0]
