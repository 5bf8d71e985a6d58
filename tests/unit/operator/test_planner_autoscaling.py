"""The planner with spec.autoscaling: the groups' signals (their node-0 /metrics) drive the
replicas written to the spec, with the decision in the status and an Event; with
disaggregation each role scales on its own signal."""

from __future__ import annotations

from shoal_operator.actions import ScaleRole
from shoal_operator.observed import EngineSignals
from tests.unit.operator.factories import Clock
from tests.unit.operator.fake_api import FakeApi

COLOCATED = {"replicas": 1,
             "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "metric": "queuedRequests",
                             "target": 2,
                             "behavior": {"scaleDown": {"stabilizationWindowSeconds": 30}}}}
METRICS = """# TYPE shoal:num_queue_reqs gauge
shoal:num_queue_reqs {queued}
# TYPE shoal:num_running_reqs gauge
shoal:num_running_reqs {running}
# TYPE shoal:token_usage gauge
shoal:token_usage {usage}
"""


def signals(queued: float = 0, running: float = 0, usage: float = 0) -> EngineSignals:
    return EngineSignals.from_metrics(METRICS.format(queued=queued, running=running,
                                                     usage=usage))


def test_metrics_text_gives_the_three_signals() -> None:
    parsed = signals(queued=3, running=5, usage=0.25)
    assert parsed.value("queuedRequests") == 3
    assert parsed.value("runningRequests") == 5
    assert parsed.value("kvCacheUsage") == 0.25


def test_a_queue_adds_a_group_and_idleness_removes_it_after_the_window() -> None:
    clock = Clock()
    api = FakeApi(COLOCATED)
    api.converge(clock.now)
    container = api.pods["llm-0-0"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHOAL_ENABLE_METRICS"] == "true"

    api.signals = {"llm-0": signals(queued=5)}
    result = api.step(clock.advance(15))
    assert ScaleRole("engine", 2) in result.actions
    assert result.requeue_after == 15
    assert api.body["spec"]["replicas"] == 2
    scaled = [e for e in api.events.values() if e["reason"] == "Scaled"]
    assert len(scaled) == 1 and scaled[0]["type"] == "Normal"
    assert "engine groups 1 -> 2" in scaled[0]["message"]
    record = api.status["autoscaling"][0]
    assert record["role"] == "engine" and record["signal"] == 5 and record["desiredReplicas"] == 2
    assert record["lastDecision"]["from"] == 1 and record["lastDecision"]["to"] == 2

    api.converge(clock.now)
    assert api.live_pods() == ["llm-0-0", "llm-1-0"]
    api.signals = {"llm-0": signals(), "llm-1": signals()}
    api.step(clock.advance(15))
    assert api.body["spec"]["replicas"] == 2  # within the 30 s window
    api.step(clock.advance(31))
    assert api.body["spec"]["replicas"] == 1
    api.converge(clock.now)
    assert api.live_pods() == ["llm-0-0"]
    assert api.status["autoscaling"][0]["lastDecision"]["to"] == 1


def test_a_group_that_is_not_ready_is_not_counted() -> None:
    clock = Clock()
    api = FakeApi({**COLOCATED, "replicas": 2})
    api.converge(clock.now)
    api.pods["llm-1-0"]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    api.signals = {"llm-0": signals(queued=2), "llm-1": signals(queued=50)}
    api.step(clock.advance(15))
    assert api.body["spec"]["replicas"] == 2
    assert api.status["autoscaling"][0]["readyGroups"] == 1
    assert api.status["autoscaling"][0]["signal"] == 2


def test_prefill_and_decode_scale_on_their_own_signals() -> None:
    clock = Clock()
    rules = {"minReplicas": 1, "maxReplicas": 3}
    api = FakeApi({"disaggregation": {
        "prefill": {"replicas": 1, "autoscaling": {**rules, "target": 2}},
        "decode": {"replicas": 2, "autoscaling": {**rules, "target": 0.5}}},
        "router": {}})
    api.converge(clock.now)
    api.signals = {"llm-prefill-0": signals(queued=6),
                   "llm-decode-0": signals(usage=0.5), "llm-decode-1": signals(usage=0.5)}
    api.step(clock.advance(15))
    disaggregation = api.body["spec"]["disaggregation"]
    assert disaggregation["prefill"]["replicas"] == 3  # queued prompts: ceil(6 / 2)
    assert disaggregation["decode"]["replicas"] == 2  # KV usage on target
    metrics = {r["role"]: r["metric"] for r in api.status["autoscaling"]}
    assert metrics == {"prefill": "queuedRequests", "decode": "kvCacheUsage"}
