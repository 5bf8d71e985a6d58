"""What the API refuses to create (a 422 for a limit below its request, a 403 from Pod Security
or a ResourceQuota) is visible: the pass stops with CreateRefused naming the object and the
API's message, the next passes set Degraded `CreateRefused` and post one Warning Event while the
refusal lasts, and once the API accepts, the pods come and Degraded clears."""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

import pytest
from kubernetes.client import ApiException

from shoal_operator.actions import Action, CreatePods
from shoal_operator.metrics import OperatorMetrics
from shoal_operator.reconcile import CreateRefused, reconcile
from tests.unit.operator.factories import CONFIG, Clock
from tests.unit.operator.fake_api import FakeApi

QUOTA = ('pods "llm-0-0" is forbidden: exceeded quota: compute, requested: limits.cpu=4, '
         'used: limits.cpu=0, limited: limits.cpu=2')


class RefusingKube:
    """The operator's Kube over a FakeApi, refusing pods with a 403 while `refusing` holds."""

    def __init__(self, api: FakeApi, clock: Clock) -> None:
        self.api, self.clock, self.refusing = api, clock, True

    def read_model_deployment(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.api.body)

    def list_children(self, namespace: str, name: str) -> tuple[list[dict[str, Any]], ...]:
        return (copy.deepcopy(list(self.api.pods.values())), list(self.api.services.values()),
                list(self.api.deployments.values()), list(self.api.network_policies.values()))

    def apply(self, body: dict[str, Any], action: Action) -> None:
        if self.refusing and isinstance(action, CreatePods):
            error = ApiException(status=403, reason="Forbidden")
            error.body = json.dumps({"kind": "Status", "message": QUOTA, "code": 403})
            raise error
        self.api.apply(action)


def _pass(kube: RefusingKube, refused: str, now: datetime) -> str:
    """One reconcile pass; the CreateRefused it ended on ("" if none)."""
    try:
        reconcile(kube, "ns", "llm", CONFIG, OperatorMetrics(), refused)  # type: ignore[arg-type]
    except CreateRefused as exc:
        return str(exc)
    return ""


def test_a_refused_pod_is_a_degraded_condition_and_one_event_until_the_api_accepts() -> None:
    clock = Clock()
    api = FakeApi({"engine": {"resources": {"limits": {"cpu": "4"}}}})
    kube = RefusingKube(api, clock)
    refused = _pass(kube, "", clock.now)
    assert refused.startswith("create pods llm-0-0: the API refused it (403): ")
    assert refused.endswith(QUOTA)
    assert not api.pods and api.services  # the Services went first

    for _ in range(3):  # the status and one Event say it while it lasts
        assert _pass(kube, refused, clock.advance(10)) == refused
        degraded = api.condition("Degraded")
        assert (degraded["status"], degraded["reason"], degraded["message"]) == \
            ("True", "CreateRefused", refused)
    (event,) = [e for e in api.events.values() if e["reason"] == "CreateRefused"]
    assert event["type"] == "Warning" and event["message"] == refused

    kube.refusing = False  # the quota is raised
    assert _pass(kube, refused, clock.advance(10)) == ""
    assert sorted(api.pods) == ["llm-0-0"]
    assert _pass(kube, "", clock.advance(1)) == ""
    assert api.condition("Degraded")["reason"] == "NoFailedGroups"


@pytest.mark.parametrize("status", [409, 500])
def test_conflicts_and_server_errors_are_not_refusals(status: int) -> None:
    clock = Clock()
    kube = RefusingKube(FakeApi(), clock)

    def fail(body: dict[str, Any], action: Action) -> None:
        raise ApiException(status=status, reason="x")

    kube.apply = fail  # type: ignore[method-assign]
    with pytest.raises(ApiException):
        _pass(kube, "", clock.now)
