"""The chart's Prometheus monitors and Grafana dashboard: off by default, rendered as
prometheus-operator and Grafana's sidecar read them when on, and every PromQL expression of the
dashboard names a metric that the engine, the router or the operator exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.helm import CHART, NAMESPACE, REPO, find, only, render

MONITORING = CHART / "ci" / "monitoring-values.yaml"
DASHBOARD = CHART / "dashboards" / "shoal.json"
METRIC_NAME = re.compile(r"shoal:[a-zA-Z0-9_:]+")

# Instantiates every metric the engine (api and scheduler), the router and the operator define
# and prints them as /metrics would: a fresh process, so the global registry starts empty.
EXPORTED = """
from prometheus_client import REGISTRY, generate_latest
from shoal.metrics.api_metrics import RequestMetrics
from shoal.metrics.scheduler_metrics import SchedulerStats
from shoal.router.metrics import RouterMetrics
from shoal_operator.metrics import OperatorMetrics
RequestMetrics()
SchedulerStats(enable_metrics=True)
for registry in (REGISTRY, RouterMetrics().registry, OperatorMetrics().registry):
    print(generate_latest(registry).decode())
"""
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created")}


def _exported_names() -> set[str]:
    text = subprocess.run([sys.executable, "-c", EXPORTED], check=True, capture_output=True,
                          text=True, timeout=120).stdout
    return {family.name + suffix for family in text_string_to_metric_families(text)
            for suffix in SUFFIXES[family.type]}


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_nothing_is_monitored_by_default() -> None:
    kinds = {o["kind"] for o in render()}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "ConfigMap", "Service"}


def test_the_monitors_scrape_the_servers_and_the_operator() -> None:
    objects = render(MONITORING)
    pod_monitor = only(objects, "PodMonitor")
    assert pod_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert pod_monitor["metadata"]["labels"]["release"] == "prometheus"
    spec = pod_monitor["spec"]
    assert spec["selector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "shoal-operator"}}
    assert spec["namespaceSelector"] == {"any": True}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics",
                                                                          "30s")
    drop = endpoint["relabelings"][0]
    assert drop["action"] == "drop" and re.fullmatch(drop["regex"], "1")
    assert not re.fullmatch(drop["regex"], "0")  # node 0 serves /metrics, the others do not

    deployment = only(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert "--metrics-port=9090" in container["args"]
    service = only(objects, "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090,
                                         "targetPort": "metrics"}]
    service_monitor = only(objects, "ServiceMonitor")["spec"]
    assert service_monitor["selector"]["matchLabels"] == deployment["spec"]["selector"][
        "matchLabels"]
    assert service_monitor["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert service_monitor["endpoints"][0]["port"] == "metrics"


def test_watched_namespaces_bound_the_pod_monitor() -> None:
    objects = render(MONITORING, set_values=["watchNamespaces={llm,batch}"])
    assert only(objects, "PodMonitor")["spec"]["namespaceSelector"] == {
        "matchNames": ["llm", "batch"]}


def test_the_dashboard_configmap_carries_the_dashboard_file() -> None:
    (config_map,) = [o for o in find(render(MONITORING), "ConfigMap")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "shoal"}
    assert json.loads(config_map["data"]["shoal.json"]) == json.loads(DASHBOARD.read_text())
    example = REPO / "examples" / "grafana-dashboard.json"
    assert json.loads(example.read_text()) == json.loads(DASHBOARD.read_text())


def test_every_dashboard_expression_names_an_exported_metric() -> None:
    exported = _exported_names()
    assert {"shoal:num_queue_reqs", "shoal:router_requests_total",
            "shoal:operator_reconcile_passes_total",
            "shoal:time_to_first_token_seconds_bucket"} <= exported
    expressions = _expressions(json.loads(DASHBOARD.read_text()))
    named: set[str] = set()
    for expr in expressions:
        found = set(METRIC_NAME.findall(expr))
        assert found, f"no shoal metric in {expr!r}"
        assert found <= exported, f"{expr!r} names {found - exported}, which nothing exports"
        named |= found
    wanted = {"shoal:generation_tokens_total", "shoal:time_to_first_token_seconds_bucket",
              "shoal:inter_token_latency_seconds_bucket", "shoal:num_queue_reqs",
              "shoal:token_usage", "shoal:cache_hit_rate", "shoal:operator_group_restarts_total",
              "shoal:operator_replicas", "shoal:operator_desired_replicas"}
    assert wanted <= named  # what issue 47 asks the dashboard to show
