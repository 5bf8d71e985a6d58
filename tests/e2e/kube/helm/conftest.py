"""release (module): the chart installed with its default values (`helm install shoal
helm/shoal --wait`, see release.py) into a namespace that enforces the `restricted` Pod Security
profile; uninstalled, if a test did not, and its namespace deleted afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.kube.helm.release import RESTRICTED_LABELS, Release, helm_release
from tests.support.kube.cluster import RunningCluster


@pytest.fixture(scope="module")
def release(running_cluster: RunningCluster) -> Iterator[Release]:
    with helm_release(running_cluster, labels=RESTRICTED_LABELS) as installed:
        yield installed
