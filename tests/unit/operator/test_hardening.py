"""What a ModelDeployment can and cannot make the operator do: pods that pass the `restricted`
Pod Security profile, a hostPath volume refused without the opt-in, the API key passed as a
Secret reference only, and the NetworkPolicy in front of the engines. The real apiserver's
admission of these objects is tested in tests/e2e/kube/operator/test_hardened.py."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from shoal_operator import builders
from shoal_operator.actions import CreatePods, EmitEvent, ReplaceStatus
from shoal_operator.planner import plan
from tests.unit.operator.factories import CONFIG, Clock, make_md
from tests.unit.operator.fake_api import FakeApi

KEY_REF = {"apiKeySecretRef": {"name": "llm-key", "key": "token"}}
SECRET_ENV = {"name": "SHOAL_API_KEY",
              "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "token"}}}
HOST_PATH = {"model": {"volume": {"hostPath": {"path": "/srv/models"}}}}
PD = {"disaggregation": {"prefill": {}, "decode": {}}, "router": {}}


def _restricted_pod(spec: dict[str, Any]) -> None:
    """The fields the `restricted` profile asks for, as built (not as defaulted later)."""
    pod_context = spec["securityContext"]
    assert pod_context["runAsNonRoot"] is True and pod_context["runAsUser"] == 10001
    assert pod_context["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in spec["containers"]:
        context = container["securityContext"]
        assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                           "capabilities": {"drop": ["ALL"]}}
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in spec["volumes"]
    assert all("hostPath" not in v for v in spec["volumes"])


def test_engine_and_router_pods_are_restricted_as_built() -> None:
    md = make_md(PD)
    for role in md.spec.roles():
        pod = builders.build_pod(md, CONFIG, 0, 0, 0, "h", role)
        _restricted_pod(pod["spec"])
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
    router = builders.build_router_deployment(md, CONFIG)
    _restricted_pod(router["spec"]["template"]["spec"])


def test_a_pod_template_security_context_is_merged_over_the_defaults() -> None:
    md = make_md({"podTemplate": {"securityContext": {"runAsUser": 20000,
                                                      "supplementalGroups": [5]}}})
    context = builders.build_pod(md, CONFIG, 0, 0, 0, "h")["spec"]["securityContext"]
    assert context == {"runAsNonRoot": True, "runAsUser": 20000, "runAsGroup": 10001,
                       "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"},
                       "supplementalGroups": [5]}


def test_the_api_key_reaches_every_engine_and_the_router_as_a_secret_reference() -> None:
    md = make_md({**PD, "auth": KEY_REF})
    pods = [builders.build_pod(md, CONFIG, 0, 0, 0, "h", role) for role in md.spec.roles()]
    router = builders.build_router_deployment(md, CONFIG)
    containers = [p["spec"]["containers"][0] for p in pods] + \
        router["spec"]["template"]["spec"]["containers"]
    for container in containers:
        assert SECRET_ENV in container["env"]
        assert not any("api-key" in arg or "api_key" in arg for arg in container.get("args", []))
    without = make_md(PD)
    assert builders.template_hash(md, CONFIG) != builders.template_hash(without, CONFIG)
    assert "SHOAL_API_KEY" not in json.dumps(builders.build_pod(without, CONFIG, 0, 0, 0, "h"))


def test_a_host_path_volume_is_refused_with_a_status_and_an_event_naming_the_field() -> None:
    clock = Clock()
    api = FakeApi(HOST_PATH)
    first = api.step(clock.now)
    assert [type(a) for a in first.actions] == [EmitEvent, ReplaceStatus]
    assert not api.pods and not api.services and not api.deployments
    (event,) = api.events.values()
    assert event["reason"] == "SpecRefused" and event["type"] == "Warning"
    assert "spec.model.volume.hostPath" in event["message"]
    assert api.status["phase"] == "Failed" and api.status["observedGeneration"] == 1
    degraded = api.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "HostPathNotAllowed")
    assert "spec.model.volume.hostPath" in degraded["message"]
    assert api.condition("Available")["status"] == "False"
    assert not api.step(clock.advance(30)).actions  # said once
    # the field goes: the resource is planned as any other
    api.change_spec(model={})
    api.converge(clock.now)
    assert api.status["phase"] == "Ready" and sorted(api.pods) == ["llm-0-0"]
    assert api.condition("Degraded")["reason"] == "NoFailedGroups"


def test_a_host_path_volume_is_mounted_when_the_operator_allows_it() -> None:
    md = make_md(HOST_PATH)
    allowed = plan(md, FakeApi(HOST_PATH).observed(), Clock().now,
                   replace(CONFIG, allow_host_path=True))
    (create,) = [a for a in allowed.actions if isinstance(a, CreatePods)]
    (pod,) = create.pods
    assert {"name": "model", "hostPath": {"path": "/srv/models"}} in pod["spec"]["volumes"]


def test_the_network_policy_admits_the_resources_own_pods_and_the_client_namespaces() -> None:
    md = make_md({"networkPolicy": {"enabled": True, "clientNamespaces": ["apps", "batch"]}})
    policy = builders.build_network_policy(md)
    assert policy["metadata"]["name"] == "llm-engines"
    spec = policy["spec"]
    own = {"app.kubernetes.io/name": "shoal", "app.kubernetes.io/instance": "llm",
           "app.kubernetes.io/managed-by": "shoal-operator"}
    assert spec["podSelector"] == {"matchLabels": own, "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In",
         "values": ["engine", "prefill", "decode"]}]}
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [{"from": [
        {"podSelector": {"matchLabels": own}},
        {"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In",
             "values": ["apps", "batch"]}]}}]}]


@pytest.mark.parametrize("clients", [[], ["apps"]])
def test_the_network_policy_follows_the_spec(clients: list[str]) -> None:
    clock = Clock()
    api = FakeApi({"networkPolicy": {"enabled": True, "clientNamespaces": clients}})
    api.converge(clock.now)
    (policy,) = api.network_policies.values()
    peers = policy["spec"]["ingress"][0]["from"]
    assert len(peers) == 1 + bool(clients)
    api.change_spec(networkPolicy={"enabled": True, "clientNamespaces": ["other"]})
    api.converge(clock.now)
    peers = api.network_policies["llm-engines"]["spec"]["ingress"][0]["from"]
    assert peers[1]["namespaceSelector"]["matchExpressions"][0]["values"] == ["other"]
    api.change_spec(networkPolicy={"enabled": False})
    api.converge(clock.now)
    assert not api.network_policies
