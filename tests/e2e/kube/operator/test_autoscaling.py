"""Acceptance (issue 47): a ModelDeployment with autoscaling {minReplicas: 1, maxReplicas: 2,
target: 2 queued requests} on the default model. A bounded burst from the test (loopback,
stops by itself) queues requests on the one group (each server runs one request at a time), the
operator reads the queue from its /metrics and scales to 2 groups, both serve; once the burst
ends and the 30 s scale-down window has passed, back to 1 group, and no request of the burst
failed. A real Prometheus scrapes the first group's engine and the operator meanwhile, and every
expression of the chart's dashboard runs on it."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.kube.operator.conftest import (
    ENGINE_ARGS,
    GROUP_READY_S,
    ONE_CORE_EACH,
    Deployments,
    Operator,
)
from tests.support.helm import CHART
from tests.support.prometheus import Prometheus, Target, prometheus
from tests.support.wait import wait_until

NAME = "auto"
SPEC = {"replicas": 1,
        "engine": {"args": [*ENGINE_ARGS, "--max-running-requests", "1"],
                   "resources": ONE_CORE_EACH},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "metric": "queuedRequests",
                        "target": 2, "behavior": {
                            "scaleDown": {"stabilizationWindowSeconds": 30, "maxGroups": 1,
                                          "periodSeconds": 15}}}}
DASHBOARD = CHART / "dashboards" / "shoal.json"
CLIENTS = 6  # concurrent requests: 5 queued behind the one running
BURST_S = 480.0  # the burst's own bound


def _ready_endpoints(mds: Deployments) -> dict[str, str]:
    """http://IP:PORT -> pod name of every ready endpoint of the ModelDeployment's Service."""
    found = {}
    for slice_ in mds.discovery.list_namespaced_endpoint_slice(
            mds.namespace, label_selector=f"kubernetes.io/service-name={NAME}").items:
        port = next((p.port for p in slice_.ports or [] if p.name == "http"), None)
        found.update({f"http://{e.addresses[0]}:{port}": e.target_ref.name
                      for e in slice_.endpoints or [] if e.conditions.ready and port})
    return found


def _ready_addresses(mds: Deployments) -> list[str]:
    return sorted(_ready_endpoints(mds))


class Burst:
    """CLIENTS threads sending chat completions, spread over the ready endpoints, until
    stopped or BURST_S passed; every answer is kept."""

    def __init__(self, mds: Deployments) -> None:
        self.mds, self.stop = mds, threading.Event()
        self.results: list[tuple[str, int, str]] = []
        self.turn = itertools.count()
        self.deadline = time.monotonic() + BURST_S
        self.threads = [threading.Thread(target=self._client) for _ in range(CLIENTS)]

    def __enter__(self) -> Burst:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _client(self) -> None:
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            addresses = _ready_addresses(self.mds)
            if not addresses:
                time.sleep(0.5)
                continue
            address = addresses[next(self.turn) % len(addresses)]
            try:
                response = httpx.post(f"{address}/v1/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": "Count to twenty."}],
                    "max_tokens": 24, "temperature": 0})
                self.results.append((address, response.status_code, response.text[:200]))
            except httpx.HTTPError as exc:
                self.results.append((address, 0, repr(exc)))

    def served_by(self, address: str) -> bool:
        return any(a == address and code == 200 for a, code, _ in self.results)


def test_a_burst_scales_to_two_groups_that_both_serve_and_back_to_one(
        deployments: Deployments, operator: Operator, tmp_path: Path) -> None:
    deployments.create(NAME, SPEC)
    deployments.wait_ready(NAME)
    ((first, pod),) = _ready_endpoints(deployments).items()
    targets = [Target(first, "engines", {"modeldeployment": NAME, "pod": pod}),
               Target(operator.metrics_url, "operator", {})]
    with prometheus(targets, tmp_path / "prometheus") as scraper, Burst(deployments) as burst:
        wait_until(lambda: deployments.get(NAME)["spec"]["replicas"] == 2, 180,
                   what="not scaled up to 2 groups")
        status = deployments.wait_ready(NAME, GROUP_READY_S)
        assert status["readyReplicas"] == 2
        (second,) = [a for a in _ready_addresses(deployments) if a != first]
        wait_until(lambda: burst.served_by(second) and burst.served_by(first), 120,
                   what="both groups did not serve")
        _dashboard_expressions_answer(scraper)
    assert burst.results and all(code == 200 for _, code, _ in burst.results), \
        [r for r in burst.results if r[1] != 200][:5]

    _dashboard_engine_metrics_are_live(first)

    up = deployments.status(NAME)["autoscaling"][0]
    assert up["role"] == "engine" and up["metric"] == "queuedRequests"
    wait_until(lambda: deployments.get(NAME)["spec"]["replicas"] == 1, 180,
               what="not scaled back to 1 group")
    status = deployments.wait_ready(NAME)
    assert [g["name"] for g in status["groups"]] == [f"{NAME}-0"]
    assert status["autoscaling"][0]["lastDecision"]["to"] == 1
    messages = [e.message for e in deployments.events(NAME) if e.reason == "Scaled"]
    assert any("engine groups 1 -> 2" in m for m in messages), messages
    assert any("engine groups 2 -> 1" in m for m in messages), messages


def _dashboard_expressions_answer(scraper: Prometheus) -> None:
    """Each of the dashboard's expressions (Grafana's $__rate_interval and $__range filled in)
    runs on Prometheus; those on the engine's and the operator's series have data, except
    the group restarts and the routers', which nothing here made; the desired replicas read 2."""
    wait_until(lambda: scraper.scraped("engines") and scraper.scraped("operator"), 30,
               what="Prometheus did not scrape the engine and the operator")
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"].replace("$__rate_interval", "1m").replace("$__range", "15m")
             for panel in dashboard["panels"] for target in panel["targets"]]
    empty = [expr for expr in exprs if not scraper.query(expr)]
    assert all(re.search(r"shoal:(router_|operator_group_restarts)", e) for e in empty), empty
    desired = scraper.query(f'shoal:operator_desired_replicas{{modeldeployment="{NAME}"}}')
    assert [sample["value"][1] for sample in desired] == ["2"], desired


def _dashboard_engine_metrics_are_live(address: str) -> None:
    """Every engine metric the dashboard names (not the router's or the operator's) is in the
    served engine's live /metrics after the burst."""
    text = httpx.get(f"{address}/metrics", timeout=10).text
    live = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    named = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"shoal:[a-zA-Z0-9_:]+", target["expr"])
             if not name.startswith(("shoal:router_", "shoal:operator_"))}
    assert named and named <= live, named - live
