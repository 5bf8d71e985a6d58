"""The objects the operator creates: a group's pods (names, DNS, env, labels, owner, probe,
termination message), the two Services, the Events."""

from __future__ import annotations

from shoal_operator import builders
from shoal_operator.config import OperatorConfig
from tests.unit.operator.factories import CONFIG, MD_UID, Clock, make_md

SPEC = {"image": "shoal:1", "engine": {"tp": 2, "nnodes": 2, "args": ["--watchdog-timeout", "5"],
                                       "env": [{"name": "SHOAL_FAULT", "value": "x"},
                                               {"name": "SHOAL_PORT", "value": "31000"}],
                                       "resources": {"limits": {"cpu": "1"}}},
        "model": {"path": "/models/m", "servedName": "m",
                  "volume": {"persistentVolumeClaim": {"claimName": "weights"}}},
        "podTemplate": {"nodeSelector": {"pool": "gpu"}, "priorityClassName": "high"}}


def _env(pod: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in
            pod["spec"]["containers"][0]["env"]}


def test_a_pod_of_a_multi_node_group() -> None:
    md = make_md(SPEC)
    pod = builders.build_pod(md, CONFIG, replica=1, node_rank=1, incarnation=3, hash_="abc")
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "llm-1-1" and meta["namespace"] == "ns"
    assert meta["labels"] == {
        "app.kubernetes.io/name": "shoal", "app.kubernetes.io/instance": "llm",
        "app.kubernetes.io/managed-by": "shoal-operator", "app.kubernetes.io/component": "engine",
        "shoal.dev/group": "llm-1", "shoal.dev/replica": "1", "shoal.dev/node-rank": "1",
        "shoal.dev/incarnation": "3", "shoal.dev/template-hash": "abc"}
    assert meta["ownerReferences"] == [{
        "apiVersion": "shoal.dev/v1alpha1", "kind": "ModelDeployment", "name": "llm",
        "uid": MD_UID, "controller": True, "blockOwnerDeletion": True}]
    assert spec["restartPolicy"] == "Never"
    assert spec["hostname"] == "llm-1-1" and spec["subdomain"] == "llm-nodes"
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["priorityClassName"] == "high"
    (container,) = spec["containers"]
    assert container["image"] == "shoal:1"
    assert container["args"] == ["--watchdog-timeout", "5"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"] == {"limits": {"cpu": "1"}}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights"}} in spec["volumes"]
    assert _env(pod) == {
        "SHOAL_HOST": {"fieldRef": {"fieldPath": "status.podIP"}},
        "SHOAL_PORT": "31000",  # the user's value replaces the operator's, in place
        "SHOAL_TP": "2", "SHOAL_PP": "1", "SHOAL_NNODES": "2", "SHOAL_NODE_RANK": "1",
        "SHOAL_DISAGGREGATION_MODE": "null", "SHOAL_TERMINATION_LOG": "/dev/termination-log",
        "SHOAL_DIST_INIT_ADDR": "llm-1-0.llm-nodes.ns.svc.cluster.local:29500",
        "SHOAL_MODEL_PATH": "/models/m", "SHOAL_SERVED_MODEL_NAME": "m", "SHOAL_FAULT": "x"}
    names = [e["name"] for e in container["env"]]
    assert names.index("SHOAL_PORT") < names.index("SHOAL_FAULT")  # user extras come last


def test_a_one_node_group_picks_its_own_rendezvous_and_uses_the_default_image() -> None:
    md = make_md({"engine": {"tp": 2}})
    pod = builders.build_pod(md, OperatorConfig(default_image="shoal:dflt", cluster_domain="c"),
                             0, 0, 0, "h")
    assert "SHOAL_DIST_INIT_ADDR" not in _env(pod) and "SHOAL_MODEL_PATH" not in _env(pod)
    assert pod["spec"]["containers"][0]["image"] == "shoal:test"  # md parsed with CONFIG
    assert [p["name"] for p in pod["spec"]["containers"][0]["ports"]] == ["http"]


def test_the_cluster_domain_reaches_the_rendezvous_address() -> None:
    md = make_md({"engine": {"nnodes": 2, "tp": 2}})
    pod = builders.build_pod(md, OperatorConfig(cluster_domain="corp.example"), 0, 1, 0, "h")
    assert _env(pod)["SHOAL_DIST_INIT_ADDR"] == "llm-0-0.llm-nodes.ns.svc.corp.example:29500"


def test_services() -> None:
    md = make_md(SPEC)
    headless = builders.build_headless_service(md)
    assert headless["metadata"]["name"] == "llm-nodes"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert "shoal.dev/node-rank" not in headless["spec"]["selector"]
    service = builders.build_service(md)
    assert service["metadata"]["name"] == "llm"
    assert service["spec"]["selector"]["shoal.dev/node-rank"] == "0"
    assert service["spec"]["ports"] == [{"name": "http", "port": 30000, "targetPort": "http"}]
    for obj in (headless, service):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == MD_UID


def test_an_event_names_the_model_deployment() -> None:
    md = make_md(SPEC)
    event = builders.build_event(md, "llm-0.x.restart-1", "GroupRestart", "Warning", "why",
                                 Clock().now)
    assert event["involvedObject"] == {"apiVersion": "shoal.dev/v1alpha1",
                                       "kind": "ModelDeployment", "name": "llm",
                                       "namespace": "ns", "uid": MD_UID}
    assert event["firstTimestamp"] == "2026-01-01T00:00:00Z" and event["count"] == 1


def test_gpu_pods_ask_for_a_gpu_per_rank_and_run_on_cuda() -> None:
    """`spec.engine.accelerator: nvidia.com/gpu`: each pod's limits hold one GPU per rank it runs
    (tp * pp / nnodes), prefill and decode pods each by their own parallelism; CPU pods none."""
    md = make_md({"engine": {"tp": 4, "pp": 2, "nnodes": 2, "accelerator": "nvidia.com/gpu",
                             "resources": {"limits": {"memory": "16Gi"}}}})
    pod = builders.build_pod(md, CONFIG, replica=0, node_rank=1, incarnation=0, hash_="h")
    assert pod["spec"]["containers"][0]["resources"] == {
        "limits": {"memory": "16Gi", "nvidia.com/gpu": 4}}
    assert _env(pod)["SHOAL_DEVICE"] == "cuda"
    assert md.spec.engine.resources == {"limits": {"memory": "16Gi"}}  # the spec stays as given
    pd = make_md({"engine": {"accelerator": "nvidia.com/gpu"},
                  "disaggregation": {"prefill": {"tp": 2}, "decode": {"tp": 1}}})
    prefill, decode = pd.spec.disaggregation
    for role, gpus in ((prefill, 2), (decode, 1)):
        role_pod = builders.build_pod(pd, CONFIG, replica=0, node_rank=0, incarnation=0,
                                      hash_="h", role=role)
        assert role_pod["spec"]["containers"][0]["resources"] == {
            "limits": {"nvidia.com/gpu": gpus}}
    cpu = builders.build_pod(make_md({"engine": {"tp": 2}}), CONFIG, replica=0, node_rank=0,
                             incarnation=0, hash_="h")
    assert cpu["spec"]["containers"][0]["resources"] == {}
    assert "SHOAL_DEVICE" not in _env(cpu)
