"""Times as the Kubernetes API writes them."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(when: datetime | None = None) -> str:
    return (when or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
