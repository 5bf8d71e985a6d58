"""Acceptance 5 (issue 13): a ModelDeployment with one prefill group, one decode group and a
router, on the default model. Chat completions go through the router's Service; a decode pod's
watchdog exit recreates the decode group and nothing else, and the router pairs the new decode
server with the prefill server it kept.

Every server carries `SHOAL_FAULT=hang_forward:rank=0:after_steps=40` (spec.engine.env reaches
both roles): a prefill server runs one forward per short prompt and never gets there, a decode
server runs one per output token, so a request of 60 tokens hangs the decode's rank (watchdog:
5 s) while short requests work. Last, a changed router policy patches the router's
Deployment."""

from __future__ import annotations

import kubernetes
import pytest

from tests.e2e.kube.operator.conftest import (
    ENGINE_ARGS,
    ONE_CORE_EACH,
    Deployments,
    wait_restarted,
)
from tests.support.wait import wait_until

NAME = "pd"
ROUTER = f"{NAME}-router"
FAULT = {"name": "SHOAL_FAULT", "value": "hang_forward:rank=0:after_steps=40"}


@pytest.fixture(scope="module")
def mds(module_deployments: Deployments) -> Deployments:
    module_deployments.create(NAME, {
        "engine": {"args": ENGINE_ARGS, "env": [FAULT]},
        "disaggregation": {"prefill": {"replicas": 1, "resources": ONE_CORE_EACH},
                           "decode": {"replicas": 1, "resources": ONE_CORE_EACH}},
        "router": {"replicas": 1, "policy": "round_robin"},
        "restartPolicy": {"backoff": {"initialSeconds": 3, "maxSeconds": 6}},
    })
    module_deployments.wait_ready(NAME)
    return module_deployments


def _assert_serves(mds: Deployments) -> None:
    response = mds.chat(ROUTER, max_tokens=8)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].strip()


def _roles(mds: Deployments) -> dict[str, str]:
    """Pod name → its app.kubernetes.io/component (prefill, decode, router)."""
    return {p.metadata.name: p.metadata.labels["app.kubernetes.io/component"]
            for p in mds.pods(NAME) if not p.metadata.deletion_timestamp}


def test_prefill_and_decode_groups_serve_through_the_routers_service(
        mds: Deployments) -> None:
    status = mds.status(NAME)
    assert status["endpoint"] == f"{ROUTER}.{mds.namespace}.svc.cluster.local:30000"
    assert {(g["name"], g["role"], g["phase"]) for g in status["groups"]} == {
        (f"{NAME}-prefill-0", "prefill", "Ready"), (f"{NAME}-decode-0", "decode", "Ready")}
    roles = _roles(mds)
    assert sorted(r for r in roles.values()) == ["decode", "prefill", "router"]
    for pod in mds.pods(NAME):
        if roles.get(pod.metadata.name) in ("prefill", "decode"):
            env = {e.name: e.value for e in pod.spec.containers[0].env}
            assert env["SHOAL_DISAGGREGATION_MODE"] == roles[pod.metadata.name]
            mds.rank_process(pod.metadata.name, "shoal::scheduler_TP0")
    assert {f"{NAME}-prefill-nodes", f"{NAME}-decode-nodes", ROUTER} <= set(mds.services(NAME))
    _assert_serves(mds)


def test_a_decode_pods_watchdog_exit_recreates_only_the_decode_group(
        mds: Deployments) -> None:
    before = mds.pod_uids(NAME)
    roles = _roles(mds)
    decode = {n: uid for n, uid in before.items() if roles[n] == "decode"}
    kept = {n: uid for n, uid in before.items() if roles[n] != "decode"}
    mds.chat_until_it_breaks(ROUTER, max_tokens=60)
    status = wait_restarted(mds, NAME, "watchdog", 1, decode)
    groups = {g["name"]: g for g in status["groups"]}
    assert groups[f"{NAME}-decode-0"]["restarts"] == 1
    assert groups[f"{NAME}-decode-0"]["lastRestartReason"] == "watchdog"
    assert groups[f"{NAME}-prefill-0"]["restarts"] == 0
    mds.wait_ready(NAME)
    after = mds.pod_uids(NAME)
    assert {n: after.get(n) for n in kept} == kept  # the prefill and router pods stayed
    assert set(after) == set(before)  # one new decode pod, the same name
    _assert_serves(mds)  # the router found the new decode server by its Service's records


def test_a_changed_router_policy_patches_the_routers_deployment(mds: Deployments) -> None:
    apps = kubernetes.client.AppsV1Api(mds.cluster.api_client())

    def args() -> list[str]:
        deployment = apps.read_namespaced_deployment(ROUTER, mds.namespace)
        return deployment.spec.template.spec.containers[0].args
    assert "round_robin" in args()
    mds.patch_spec(NAME, {"router": {"policy": "cache_aware"}})
    wait_until(lambda: "cache_aware" in args(), 30, what="the router's Deployment not patched")
    assert args().count("--service") == 2  # the lists were replaced, not merged
