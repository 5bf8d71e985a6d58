"""Every shipped example is a test: `examples/prefill-decode.yaml`, `multi-node.yaml` and
`autoscaling.yaml` are applied as they are (`colocated-tp2.yaml`:
tests/e2e/kube/helm/test_helm_install.py, through the chart) and must reach Ready and answer a
chat completion through their `status.endpoint`; `gpu-tp2.yaml` is validated by the real
apiserver (the test cluster has no GPUs).

The one overlay (`_on_two_cores`): each engine pod gets a CPU limit of one core (and a CPU
request of at most one), the test kubelet's CFS quota, which each rank sizes its threads by. The
examples ask for more cores than this 2-core host has; without the limit every rank would run a
thread per host core, and their threads would outnumber the cores many times over. Nothing else
of an example changes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.e2e.kube.operator.conftest import GROUP, PLURAL, VERSION, Deployments
from tests.support.kube.binaries import REPO

EXAMPLES = REPO / "examples"
READY_S = 600.0  # every pod loads the model on 2 shared cores


def _on_two_cores(spec: dict[str, Any]) -> dict[str, Any]:
    """The example's spec with a one-core CPU limit on each of its engine pods (and a CPU
    request of at most that: a pod may not request more than its limit)."""
    spec = copy.deepcopy(spec)
    roles = spec.get("disaggregation")
    for block in roles.values() if roles else [spec["engine"]]:
        resources = block.setdefault("resources", {})
        resources.setdefault("limits", {})["cpu"] = "1"
        if "cpu" in resources.get("requests", {}):
            resources["requests"]["cpu"] = "1"
    return spec


@pytest.mark.parametrize("example", ["prefill-decode.yaml", "multi-node.yaml", "autoscaling.yaml"])
def test_the_example_reaches_ready_and_serves_through_its_endpoint(
        deployments: Deployments, example: str) -> None:
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    name = manifest["metadata"]["name"]
    deployments.create(name, _on_two_cores(manifest["spec"]))
    status = deployments.wait_ready(name, timeout=READY_S)
    service, _, rest = status["endpoint"].partition(".")
    assert rest == f"{deployments.namespace}.svc.cluster.local:30000", status["endpoint"]
    response = deployments.chat(service, max_tokens=8)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].strip()


def test_the_gpu_example_is_accepted_as_it_is(deployments: Deployments) -> None:
    """`examples/gpu-tp2.yaml` needs nodes with NVIDIA GPUs, which the test cluster has not:
    the real apiserver validates it (a server-side dry run); what its pods ask for is
    tests/unit/operator/test_builders.py::test_gpu_pods_ask_for_a_gpu_per_rank_and_run_on_cuda."""
    manifest = yaml.safe_load((EXAMPLES / "gpu-tp2.yaml").read_text())
    created = deployments.custom.create_namespaced_custom_object(
        GROUP, VERSION, deployments.namespace, PLURAL, manifest, dry_run="All")
    assert created["spec"]["engine"]["accelerator"] == "nvidia.com/gpu"
    assert not deployments.exists(manifest["metadata"]["name"])
