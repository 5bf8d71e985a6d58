"""A real Prometheus (built from its Go module by tools/prometheus/build.sh, `make kube-tools`)
scraping given /metrics targets through a static scrape config, and its query API."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from shoal.ports import free_port
from tests.support.kube.binaries import REPO, tools_dir
from tests.support.kube.processes import start_component

GO_MOD = REPO / "tools" / "prometheus" / "go.mod"
SCRAPE_INTERVAL = "1s"
READY_S = 60.0


@dataclass(frozen=True)
class Target:
    """One /metrics endpoint: http://HOST:PORT, the scrape job and extra series labels."""

    url: str
    job: str
    labels: Mapping[str, str]


def prometheus_binary() -> Path:
    """The prometheus that tools/prometheus/build.sh built for the version its go.mod pins."""
    found = re.search(r"^\s*github\.com/prometheus/prometheus (v\S+)", GO_MOD.read_text(),
                      re.MULTILINE)
    assert found, f"{GO_MOD} does not require github.com/prometheus/prometheus"
    binary = tools_dir() / f"prometheus-{found.group(1)}" / "prometheus"
    assert binary.exists(), f"{binary} is not built: run `make kube-tools`"
    return binary


def scrape_config(targets: list[Target]) -> dict[str, Any]:
    jobs: dict[str, list[dict[str, Any]]] = {}
    for target in targets:
        address = urllib.parse.urlsplit(target.url).netloc
        jobs.setdefault(target.job, []).append({"targets": [address],
                                                "labels": dict(target.labels)})
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": job, "static_configs": static}
                               for job, static in jobs.items()]}


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result; a query Prometheus refuses fails the test with its error."""
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30).json()
        assert body["status"] == "success", f"{expr!r}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scraped(self, job: str) -> bool:
        """Every target of `job` was scraped up at least once."""
        up = self.query(f'up{{job="{job}"}}')
        return bool(up) and all(sample["value"][1] == "1" for sample in up)


@contextmanager
def prometheus(targets: list[Target], workdir: Path) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1 scraping `targets` every second, its data under `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(targets)))
    port = free_port()
    component = start_component(
        "prometheus", [str(prometheus_binary()), f"--config.file={config}",
                       f"--storage.tsdb.path={workdir / 'data'}",
                       f"--web.listen-address=127.0.0.1:{port}"],
        workdir / "prometheus.log")
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        component.wait_ready(ready, READY_S)
        yield Prometheus(url)
    finally:
        component.stop()
