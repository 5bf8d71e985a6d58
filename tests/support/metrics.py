"""Reading a server's Prometheus `/metrics` in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(base_url: str) -> dict[str, float]:
    """Every unlabelled sample (or one labelled by pid only, summed over the processes)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels or set(sample.labels) <= {"pid"}:
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples
