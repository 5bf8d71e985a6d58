"""The servers behind the router: what each is (its mode and bootstrap port, from its
/server_info), whether it is healthy, and how many requests the router has in flight to it.

Workers come from the command line (`--worker`, `--prefill`, `--decode`: the mode is checked
against what the server says) or from the DNS records of headless Services (`--service
NAME:PORT`, re-resolved at every health round: a pod that is gone or not ready leaves, a new
one joins). A health round every `--health-check-interval` seconds sends `GET /health` to
every worker: `--health-failure-threshold` failures in a row take a worker out, one success
puts it back (its /server_info is read again then: a restarted server may have changed). A
connection that fails while proxying takes the worker out at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx

from shoal.router.args import RouterArgs

logger = logging.getLogger(__name__)

COLOCATED, PREFILL, DECODE = "colocated", "prefill", "decode"
MODES = {"null": COLOCATED, "prefill": PREFILL, "decode": DECODE}
CHECK_TIMEOUT_S = 5.0


@dataclass(eq=False)
class Worker:
    url: str
    expected_role: str | None = None  # as given on the command line; None: from a Service
    role: str | None = None           # as the server says (None: not known yet)
    bootstrap_port: int | None = None
    model: str | None = None
    healthy: bool = False
    failures: int = 0
    inflight: int = 0
    problem: str = ""                 # why it is never used (a server of the wrong mode)

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or ""

    @property
    def usable(self) -> bool:
        return self.healthy and self.role is not None and not self.problem

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "inflight": self.inflight, "bootstrap_port": self.bootstrap_port,
                "model": self.model, "problem": self.problem or None}


def service_urls(service: str, addresses: list[str]) -> list[str]:
    """`http://ADDRESS:PORT` for each address a Service name `NAME:PORT` resolved to."""
    port = service.rpartition(":")[2]
    return [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}"
            for a in sorted(set(addresses))]


async def resolve(name: str) -> list[str]:
    """Every address the name resolves to (none when it does not: a Service without ready
    endpoints has no records)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None,
                                                            type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return [str(info[4][0]) for info in infos]


class WorkerPool:
    def __init__(self, args: RouterArgs, client: httpx.AsyncClient) -> None:
        self.args = args
        self.client = client
        self.workers: dict[str, Worker] = {}
        for role, urls in ((COLOCATED, args.workers), (PREFILL, args.prefills),
                           (DECODE, args.decodes)):
            for url in urls:
                self.workers[url.rstrip("/")] = Worker(url.rstrip("/"), expected_role=role)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def candidates(self, role: str, exclude: set[str] = frozenset()) -> list[Worker]:
        """Usable workers of a role, in a stable order (by URL)."""
        return sorted((w for w in self.workers.values()
                       if w.usable and w.role == role and w.url not in exclude),
                      key=lambda w: w.url)

    def pairable_prefills(self, exclude: set[str] = frozenset()) -> list[Worker]:
        """Usable prefill servers with a usable decode server of the same model (a pair may
        split the model differently: each side has its own tp and pp, docs/pd.md)."""
        models = {d.model for d in self.candidates(DECODE, exclude)}
        return [p for p in self.candidates(PREFILL, exclude) if p.model in models]

    def decodes_for(self, prefill: Worker, exclude: set[str] = frozenset()) -> list[Worker]:
        """Usable decode servers of the prefill's model."""
        return [d for d in self.candidates(DECODE, exclude) if d.model == prefill.model]

    @property
    def serves(self) -> bool:
        """Whether a request can be served: a colocated worker, or a prefill and a decode of
        the same model."""
        return bool(self.candidates(COLOCATED)) or bool(self.pairable_prefills())

    def mark_failed(self, worker: Worker, why: str) -> None:
        """A connection to the worker failed while proxying: out until a check succeeds."""
        if worker.healthy:
            logger.warning("worker %s taken out: %s", worker.url, why)
        worker.healthy = False
        worker.failures = max(worker.failures, self.args.health_failure_threshold)

    async def check_all(self) -> None:
        await self._discover()
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.args.health_check_interval)
            try:
                await self.check_all()
            except Exception:  # one bad round must not end the health checks
                logger.exception("health round failed")

    async def _discover(self) -> None:
        if not self.args.services:
            return
        found: set[str] = set()
        for service in self.args.services:
            found.update(service_urls(service, await resolve(service.rpartition(":")[0])))
        for url in found - set(self.workers):
            logger.info("worker %s discovered", url)
            self.workers[url] = Worker(url)
        for url in [u for u, w in self.workers.items() if w.expected_role is None
                    and u not in found]:
            logger.info("worker %s left its Service", url)
            del self.workers[url]

    async def _check(self, worker: Worker) -> None:
        try:
            ok = (await self.client.get(worker.url + "/health",
                                        timeout=CHECK_TIMEOUT_S)).status_code == 200
            if ok and not worker.healthy:
                await self._read_info(worker)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            logger.debug("health check of %s failed: %r", worker.url, exc)
            ok = False
        if ok:
            if not worker.healthy:
                logger.info("worker %s (%s) is healthy", worker.url, worker.role)
            worker.healthy, worker.failures = True, 0
            return
        worker.failures += 1
        if worker.healthy and worker.failures >= self.args.health_failure_threshold:
            logger.warning("worker %s taken out: %d failed health checks", worker.url,
                           worker.failures)
            worker.healthy = False

    async def _read_info(self, worker: Worker) -> None:
        response = await self.client.get(worker.url + "/server_info", timeout=CHECK_TIMEOUT_S)
        response.raise_for_status()
        info = response.json()
        worker.role = MODES[info["disaggregation_mode"]]
        worker.bootstrap_port = int(info["disaggregation_bootstrap_port"])
        worker.model = info.get("served_model_name")
        worker.problem = ""
        if worker.expected_role is not None and worker.role != worker.expected_role:
            worker.problem = (f"given as a {worker.expected_role} server, but it is a "
                              f"{worker.role} server")
            logger.error("worker %s is not used: %s", worker.url, worker.problem)
