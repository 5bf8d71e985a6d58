"""The planner with spec.disaggregation and spec.router: prefill and decode groups side by side,
each recreated on its own, and the router's Deployment and Service."""

from __future__ import annotations

from shoal.lifecycle import Reason
from shoal_operator import names
from tests.unit.operator.factories import Clock
from tests.unit.operator.fake_api import FakeApi

PD = {"engine": {"args": ["--max-total-tokens", "4096"]},
      "disaggregation": {"prefill": {"replicas": 1, "tp": 2},
                         "decode": {"replicas": 2, "tp": 1, "resources": {"limits": {"cpu": "2"}}}},
      "router": {"replicas": 1, "policy": "round_robin"}}


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_prefill_and_decode_groups_run_behind_a_router() -> None:
    api = FakeApi(PD)
    api.converge(Clock().now)
    assert api.live_pods() == ["llm-decode-0-0", "llm-decode-1-0", "llm-prefill-0-0"]
    prefill, decode = api.pods["llm-prefill-0-0"], api.pods["llm-decode-1-0"]
    assert _env(prefill)["SHOAL_DISAGGREGATION_MODE"] == "prefill"
    assert _env(prefill)["SHOAL_TP"] == "2"
    assert _env(decode)["SHOAL_DISAGGREGATION_MODE"] == "decode"
    assert _env(decode)["SHOAL_TP"] == "1"
    assert decode["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "2"}}
    assert decode["spec"]["containers"][0]["args"] == ["--max-total-tokens", "4096"]
    assert prefill["metadata"]["labels"][names.COMPONENT] == "prefill"
    assert prefill["spec"]["subdomain"] == "llm-prefill-nodes"
    assert set(api.services) == {"llm", "llm-prefill-nodes", "llm-decode-nodes", "llm-router"}
    assert api.services["llm-decode-nodes"]["spec"]["selector"][names.COMPONENT] == "decode"
    assert api.services["llm-router"]["spec"]["selector"][names.COMPONENT] == "router"

    router = api.deployments["llm-router"]
    assert router["spec"]["replicas"] == 1
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["shoal"]
    assert container["args"] == [
        "router", "--host", "$(POD_IP)", "--port", "30000", "--policy", "round_robin",
        "--service", "llm-prefill-nodes.ns.svc.cluster.local:30000",
        "--service", "llm-decode-nodes.ns.svc.cluster.local:30000"]
    assert api.status["endpoint"] == "llm-router.ns.svc.cluster.local:30000"
    assert {(g["name"], g["role"], g["phase"]) for g in api.status["groups"]} == {
        ("llm-prefill-0", "prefill", "Ready"), ("llm-decode-0", "decode", "Ready"),
        ("llm-decode-1", "decode", "Ready")}
    assert api.status["phase"] == "Ready" and api.status["readyReplicas"] == 3


def test_a_decode_pods_watchdog_exit_recreates_only_its_group() -> None:
    clock = Clock()
    api = FakeApi(PD)
    api.converge(clock.now)
    created = list(api.created)
    api.end("llm-decode-0-0", 86, reason=Reason.WATCHDOG)
    api.step(clock.now)
    assert api.group_status("llm-decode-0")["restarts"] == 1
    assert api.status["restartsByReason"] == {"watchdog": 1}
    api.converge(clock.advance(11))
    assert api.created == [*created, "llm-decode-0-0"]  # the prefill and decode-1 pods stay
    assert api.group_status("llm-prefill-0")["restarts"] == 0
    assert api.live_pods() == ["llm-decode-0-0", "llm-decode-1-0", "llm-prefill-0-0"]


def test_colocated_to_disaggregated_and_back_and_the_router_follows_the_spec() -> None:
    clock = Clock()
    api = FakeApi({"replicas": 2})
    api.converge(clock.now)
    assert api.live_pods() == ["llm-0-0", "llm-1-0"] and not api.deployments
    assert api.status["endpoint"] == "llm.ns.svc.cluster.local:30000"

    api.change_spec(**PD)
    api.converge(clock.advance(1))
    assert api.live_pods() == ["llm-decode-0-0", "llm-decode-1-0", "llm-prefill-0-0"]
    assert {g["role"] for g in api.status["groups"]} == {"prefill", "decode"}

    api.change_spec(router={"replicas": 2, "policy": "cache_aware"})
    api.converge(clock.advance(1))
    router = api.deployments["llm-router"]
    assert router["spec"]["replicas"] == 2
    assert "cache_aware" in router["spec"]["template"]["spec"]["containers"][0]["args"]

    api.body["spec"].pop("disaggregation")
    api.body["spec"].pop("router")
    api.change_spec()
    api.converge(clock.advance(1))
    assert api.live_pods() == ["llm-0-0", "llm-1-0"]
    assert not api.deployments and "llm-router" not in api.services
    assert api.status["endpoint"] == "llm.ns.svc.cluster.local:30000"


def test_a_router_in_front_of_colocated_groups() -> None:
    api = FakeApi({"replicas": 2, "router": {}})
    api.converge(Clock().now)
    args = api.deployments["llm-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--service", "llm-nodes.ns.svc.cluster.local:30000"]
    assert "cache_aware" in args
    assert api.status["endpoint"] == "llm-router.ns.svc.cluster.local:30000"
