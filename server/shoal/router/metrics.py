"""The router's /metrics (its own registry; names `shoal:router_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from shoal.router.workers import WorkerPool


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("shoal:router_requests", "Requests routed to each worker",
                                ["worker", "role"], registry=self.registry)
        self.retries = Counter("shoal:router_retries", "Requests tried again on another worker",
                               registry=self.registry)
        self.inflight = Gauge("shoal:router_worker_inflight", "Requests in flight to a worker",
                              ["worker", "role"], registry=self.registry)
        self.healthy = Gauge("shoal:router_worker_healthy", "1 when a worker takes requests",
                             ["worker", "role"], registry=self.registry)

    def render(self, pool: WorkerPool) -> bytes:
        self.inflight.clear()
        self.healthy.clear()
        for worker in pool.workers.values():
            role = worker.role or "unknown"
            self.inflight.labels(worker.url, role).set(worker.inflight)
            self.healthy.labels(worker.url, role).set(int(worker.usable))
        return generate_latest(self.registry)
