"""Issue 49 against the real test cluster: a namespace that enforces the `restricted` Pod Security
profile (the real apiserver's PodSecurity admission), a `tp: 2` ModelDeployment with a router,
an API key from a Secret and a NetworkPolicy; and a hostPath volume refused by the operator.

The tests share one ModelDeployment (starting it takes a minute here) and run in file order."""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx
import kubernetes
import pytest

from tests.e2e.kube.operator.conftest import ENGINE_ARGS, Deployments
from tests.support.wait import wait_until

NAME = "secure"
ROUTER = f"{NAME}-router"
SECRET = f"{NAME}-api-key"
RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted"
              for mode in ("enforce", "warn", "audit")}
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
        "temperature": 0}


@pytest.fixture(scope="module")
def api_key() -> str:
    return secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def restricted(module_deployments: Deployments, api_key: str) -> Deployments:
    """The module's namespace labelled restricted, the Secret, and the ModelDeployment."""
    mds = module_deployments
    mds.core.patch_namespace(mds.namespace, {"metadata": {"labels": RESTRICTED}})
    mds.core.create_namespaced_secret(mds.namespace, {
        "metadata": {"name": SECRET}, "stringData": {"token": api_key}})
    mds.create(NAME, {
        "engine": {"tp": 2, "args": ENGINE_ARGS},
        "router": {"policy": "round_robin"},
        "auth": {"apiKeySecretRef": {"name": SECRET, "key": "token"}},
        "networkPolicy": {"enabled": True, "clientNamespaces": [mds.namespace]},
    })
    return mds


@pytest.fixture
def mds(restricted: Deployments) -> Deployments:
    restricted.wait_ready(NAME)
    return restricted


def _chat(url: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers, timeout=120)


def _serialized(client: kubernetes.client.ApiClient, objects: list[Any]) -> str:
    return json.dumps(client.sanitize_for_serialization(objects))


def test_the_namespace_enforces_the_restricted_profile(restricted: Deployments) -> None:
    """The real PodSecurity admission refuses a pod that runs as root with privilege."""
    with pytest.raises(kubernetes.client.ApiException) as refused:
        restricted.core.create_namespaced_pod(restricted.namespace, {
            "metadata": {"name": "root"},
            "spec": {"containers": [{"name": "c", "image": "shoal",
                                     "securityContext": {"privileged": True}}]}})
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in message and "privileged" in message


def test_a_tp2_group_and_its_router_come_up_restricted_and_serve(mds: Deployments) -> None:
    pods = {p.metadata.labels["app.kubernetes.io/component"]: p for p in mds.pods(NAME)}
    assert sorted(pods) == ["engine", "router"]
    for pod in pods.values():
        assert pod.spec.security_context.run_as_non_root is True
        assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
        (container,) = pod.spec.containers
        assert container.security_context.read_only_root_filesystem is True
        assert container.security_context.capabilities.drop == ["ALL"]
    titles = " ".join(" ".join(p.cmdline()) for p in
                      mds.kubelet.pod_processes(mds.namespace, pods["engine"].metadata.name))
    assert "shoal::scheduler_TP0" in titles and "shoal::scheduler_TP1" in titles


def test_the_key_is_checked_at_the_router_and_at_the_engine(mds: Deployments,
                                                             api_key: str) -> None:
    for url in (mds.serving_address(ROUTER), mds.serving_address(NAME)):
        assert _chat(url, None).status_code == 401, url
        wrong = _chat(url, "not-the-key")
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        answer = _chat(url, api_key)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"].strip()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # open


def test_the_key_is_only_a_secret_reference(mds: Deployments, api_key: str) -> None:
    client = mds.cluster.api_client()
    pods = mds.pods(NAME)
    for pod in pods:
        (container,) = pod.spec.containers
        (env,) = [e for e in container.env if e.name == "SHOAL_API_KEY"]
        assert env.value is None
        assert (env.value_from.secret_key_ref.name, env.value_from.secret_key_ref.key) == \
            (SECRET, "token")
    apps = kubernetes.client.AppsV1Api(client)
    seen = {
        "pod specs": _serialized(client, pods),
        "the router's Deployment": _serialized(client, [apps.read_namespaced_deployment(
            ROUTER, mds.namespace)]),
        "the ModelDeployment": json.dumps(mds.get(NAME)),
        "Events": _serialized(client, mds.core.list_namespaced_event(mds.namespace).items),
        "argv": " ".join(" ".join(p.cmdline()) for pod in pods
                         for p in mds.kubelet.pod_processes(mds.namespace, pod.metadata.name)),
        "logs": "".join(mds.kubelet.pod_log(mds.namespace, pod.metadata.name)
                        for pod in pods),
    }
    assert seen["argv"] and seen["logs"]
    for where, text in seen.items():
        assert api_key not in text, f"the key is in {where}"


def test_the_network_policy_selects_the_engines_and_admits_the_routers(
        mds: Deployments) -> None:
    """The apiserver stored and validated the policy; its selectors, evaluated by the apiserver
    itself as label selectors, pick the engine pods (the policy's subject) and the resource's
    own pods (its peers). The test cluster does not enforce NetworkPolicy."""
    networking = kubernetes.client.NetworkingV1Api(mds.cluster.api_client())
    policy = networking.read_namespaced_network_policy(f"{NAME}-engines", mds.namespace)
    assert policy.metadata.owner_references[0].name == NAME
    assert policy.spec.policy_types == ["Ingress"]

    def selected(selector: Any) -> set[str]:
        terms = [f"{k}={v}" for k, v in (selector.match_labels or {}).items()]
        terms += [f"{e.key} {e.operator.lower()} ({','.join(e.values)})"
                  for e in selector.match_expressions or []]
        return {p.metadata.name for p in mds.core.list_namespaced_pod(
            mds.namespace, label_selector=",".join(terms)).items}

    components = {p.metadata.name: p.metadata.labels["app.kubernetes.io/component"]
                  for p in mds.pods(NAME)}
    engines = {name for name, role in components.items() if role == "engine"}
    assert selected(policy.spec.pod_selector) == engines
    (rule,) = policy.spec.ingress
    own, clients = rule._from  # noqa: SLF001 (the client's name for `from`)
    assert selected(own.pod_selector) == set(components)  # the engines and the router
    (expression,) = clients.namespace_selector.match_expressions
    assert (expression.key, expression.values) == ("kubernetes.io/metadata.name",
                                                   [mds.namespace])


def test_a_host_path_volume_is_refused_naming_the_field(restricted: Deployments) -> None:
    mds = restricted
    mds.create("node-files", {"model": {"volume": {"hostPath": {"path": "/etc"}}}})

    def degraded() -> dict[str, Any] | None:
        condition = next((c for c in mds.status("node-files").get("conditions", [])
                          if c["type"] == "Degraded"), None)
        return condition if condition and condition["status"] == "True" else None

    condition = wait_until(degraded, 60, what="node-files not Degraded")
    assert condition["reason"] == "HostPathNotAllowed"
    assert "spec.model.volume.hostPath" in condition["message"]
    assert mds.status("node-files")["phase"] == "Failed"
    event = wait_until(lambda: next((e for e in mds.events("node-files")
                                     if e.reason == "SpecRefused"), None), 30,
                       what="no SpecRefused event")
    assert event.type == "Warning" and "spec.model.volume.hostPath" in event.message
    assert not mds.pods("node-files") and not mds.services("node-files")
