"""Acceptance 6: the apiserver refuses invalid ModelDeployments by the CRD's schema alone, with a
message that names the field; defaults are filled in."""

from __future__ import annotations

import json
from typing import Any

import kubernetes
import pytest

from tests.e2e.kube.operator.conftest import Deployments

INVALID = [
    ({"engine": {"tp": 0}}, "spec.engine.tp"),
    ({"replicas": -1}, "spec.replicas"),
    ({"restartPolicy": {"recreateGroupOn": ["watchdog", "sunspots"]}},
     "spec.restartPolicy.recreateGroupOn[1]"),
    ({"restartPolicy": {"recreateGroupOn": ["startup-failed"]}},
     "spec.restartPolicy.recreateGroupOn[0]"),
    ({"engine": {"nnodes": 0}}, "spec.engine.nnodes"),
    ({"engine": {"tp": 3, "nnodes": 2}}, "spec.engine"),
    ({"restartPolicy": {"maxGroupRestarts": -1}}, "spec.restartPolicy.maxGroupRestarts"),
    ({"restartPolicy": {"backoff": {"initialSeconds": 60, "maxSeconds": 10}}},
     "spec.restartPolicy.backoff"),
    ({"rollout": {"maxUnavailable": 0, "maxSurge": 0}}, "spec.rollout"),
    ({"router": {"policy": "fastest"}}, "spec.router.policy"),
    ({"model": {"volume": {}}}, "spec.model.volume"),
    ({"engine": {"tp": "two"}}, "spec.engine.tp"),
]


def _refusal(mds: Deployments, name: str, spec: dict[str, Any]) -> str:
    with pytest.raises(kubernetes.client.ApiException) as refused:
        mds.create(name, spec)
    assert refused.value.status == 422
    return json.loads(refused.value.body)["message"]


@pytest.mark.parametrize("spec,field", INVALID, ids=[f for _, f in INVALID])
def test_an_invalid_spec_is_refused_naming_the_field(deployments: Deployments,
                                                     spec: dict[str, Any], field: str) -> None:
    message = _refusal(deployments, "bad", spec)
    assert f"{field}:" in message, message
    assert not deployments.exists("bad")


@pytest.mark.parametrize("name", ["has.dot", "9starts-with-digit", "x" * 46])
def test_a_name_that_cannot_be_a_hostname_is_refused(deployments: Deployments,
                                                     name: str) -> None:
    assert "metadata.name" in _refusal(deployments, name, {})


def test_defaults_are_filled_in(deployments: Deployments) -> None:
    spec = deployments.create("dflt", {"replicas": 0, "restartPolicy": {}})["spec"]
    assert spec["engine"] == {"tp": 1, "pp": 1, "nnodes": 1}
    assert spec["restartPolicy"] == {
        "recreateGroupOn": ["watchdog", "consensus", "peer-lost", "crash", "oom"],
        "maxGroupRestarts": 10, "backoff": {"initialSeconds": 10, "maxSeconds": 300}}
    assert spec["rollout"] == {"maxUnavailable": 1, "maxSurge": 0}
