"""The operator's own metrics, counted from the passes it plans (FakeApi plays the API), and
served on a port as Prometheus text."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from shoal.lifecycle import Reason
from shoal_operator.metrics import OperatorMetrics
from shoal_operator.observed import EngineSignals
from tests.unit.operator.factories import Clock
from tests.unit.operator.fake_api import FakeApi

LABELS = {"namespace": "ns", "modeldeployment": "llm"}


def _pass(api: FakeApi, metrics: OperatorMetrics, clock: Clock) -> None:
    md = api.md()
    metrics.observe(md, api.step(clock.now).actions)


def test_passes_restarts_and_scaling_decisions_are_counted() -> None:
    clock, metrics = Clock(), OperatorMetrics()
    api = FakeApi({"replicas": 1, "autoscaling": {"maxReplicas": 3, "target": 2}})
    api.converge(clock.now)
    api.signals = {"llm-0": EngineSignals((("queuedRequests", 5.0),))}
    clock.advance(15)
    _pass(api, metrics, clock)
    api.end("llm-0-0", 86, reason=Reason.WATCHDOG, finished_at=clock.now)
    _pass(api, metrics, clock)
    value = metrics.registry.get_sample_value
    assert value("shoal:operator_reconcile_passes_total", LABELS) == 2
    assert value("shoal:operator_scaling_decisions_total",
                 {**LABELS, "role": "engine", "direction": "up"}) == 1
    assert value("shoal:operator_group_restarts_total", {**LABELS, "reason": "watchdog"}) == 1
    assert value("shoal:operator_desired_replicas", {**LABELS, "role": "engine"}) == 3
    assert value("shoal:operator_replicas", {**LABELS, "role": "engine"}) == 3


def test_metrics_are_served_as_prometheus_text() -> None:
    metrics = OperatorMetrics()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics.serve("127.0.0.1", port)
    metrics.passes.labels("ns", "llm").inc()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "shoal:operator_reconcile_passes_total" in names
