"""The CRD file agrees with the operator: its defaults are spec.py's, its reason enum is the one
the planner recreates on, every status field the planner writes is declared (the apiserver
would prune an undeclared one), and the examples fit its schema. What the apiserver itself
refuses is tested against a real one (tests/e2e/kube/operator)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from shoal.lifecycle import Reason
from shoal_operator import names
from shoal_operator.observed import EngineSignals
from shoal_operator.spec import RECREATABLE, parse_spec
from tests.unit.operator.factories import CONFIG, Clock
from tests.unit.operator.fake_api import FakeApi

ROOT = Path(__file__).resolve().parents[3]
CRD_FILE = ROOT / "helm/shoal/crds/modeldeployments.shoal.dev.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def _default(value: Any, schema: dict[str, Any]) -> Any:
    """The apiserver's defaulting: a missing property with a default gets it, recursively."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _default(value[key], sub)
    return value


def _undeclared(value: Any, schema: dict[str, Any], path: str = "status") -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties", {})
            return [p for k, v in value.items() for p in _undeclared(v, extra, f"{path}.{k}")]
        return [f"{path}.{k}" for k in value if k not in props] + [
            p for k, v in value.items() if k in props
            for p in _undeclared(v, props[k], f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value)
                for p in _undeclared(v, schema.get("items", {}), f"{path}[{i}]")]
    return []


def test_names_scope_and_subresources(crd: dict[str, Any]) -> None:
    assert crd["metadata"]["name"] == f"{names.PLURAL}.{names.GROUP}"
    assert crd["spec"]["names"]["kind"] == names.KIND
    assert crd["spec"]["names"]["shortNames"] == ["md"]
    assert crd["spec"]["scope"] == "Namespaced"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == names.VERSION and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert {"Ready", "Phase", "Restarts", "Age"} <= set(columns)


def test_the_schema_defaults_are_the_operators(schema: dict[str, Any]) -> None:
    spec_schema = schema["properties"]["spec"]
    defaulted = _default({}, spec_schema)
    assert parse_spec(defaulted, CONFIG.default_image) == parse_spec({}, CONFIG.default_image)
    partial = _default({"restartPolicy": {"backoff": {}}, "router": {}}, spec_schema)
    assert partial["restartPolicy"]["backoff"] == {"initialSeconds": 10, "maxSeconds": 300}
    assert partial["router"] == {"replicas": 1, "policy": "cache_aware"}


def test_the_recreatable_reasons(schema: dict[str, Any]) -> None:
    recreate = schema["properties"]["spec"]["properties"]["restartPolicy"]["properties"][
        "recreateGroupOn"]
    assert recreate["items"]["enum"] == [str(r) for r in RECREATABLE]
    assert str(Reason.STARTUP_FAILED) not in recreate["items"]["enum"]


def test_every_status_field_the_planner_writes_is_declared(schema: dict[str, Any]) -> None:
    clock = Clock()
    api = FakeApi({"replicas": 3, "engine": {"nnodes": 2, "tp": 2},
                   "restartPolicy": {"maxGroupRestarts": 1}})
    api.converge(clock.now)
    api.change_spec(replicas=2)
    api.step(clock.now)
    api.end("llm-0-1", 86, reason=Reason.WATCHDOG, finished_at=clock.now)
    api.end("llm-1-1", 88, reason=Reason.STARTUP_FAILED, finished_at=clock.now)
    api.step(clock.now)
    statuses = {g["phase"] for g in api.status["groups"]}
    assert statuses == {"Restarting", "Failed", "Terminating"}
    assert _undeclared(api.status, schema["properties"]["status"]) == []
    jsonschema.validate(api.status, schema["properties"]["status"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_fit_the_schema(path: Path, schema: dict[str, Any]) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        assert doc["kind"] == names.KIND and doc["apiVersion"] == names.API_VERSION
        jsonschema.validate(doc, schema)
        assert _undeclared(doc["spec"], schema["properties"]["spec"]) == []


def test_there_are_examples_for_both_shapes() -> None:
    shapes = {(doc["spec"]["engine"].get("nnodes", 1) > 1)
              for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text())}
    assert shapes == {True, False}


def test_auth_and_network_policy_are_declared_and_read(schema: dict[str, Any]) -> None:
    spec = {"auth": {"apiKeySecretRef": {"name": "k", "key": "token"}},
            "networkPolicy": {"enabled": True, "clientNamespaces": ["apps"]}}
    jsonschema.validate({"spec": spec}, schema)
    assert _undeclared(spec, schema["properties"]["spec"]) == []
    parsed = parse_spec(spec, CONFIG.default_image)
    assert (parsed.api_key_secret.name, parsed.api_key_secret.key) == ("k", "token")
    assert parsed.network_policy.enabled and parsed.network_policy.client_namespaces == ("apps",)
    with pytest.raises(jsonschema.ValidationError, match="'key' is a required property"):
        jsonschema.validate({"spec": {"auth": {"apiKeySecretRef": {"name": "k"}}}}, schema)


def test_autoscaling_is_declared_defaulted_and_read(schema: dict[str, Any]) -> None:
    spec_schema = schema["properties"]["spec"]
    spec = {"autoscaling": {"maxReplicas": 4, "target": 2,
                            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 60}}}}
    jsonschema.validate({"spec": spec}, schema)
    assert _undeclared(spec, spec_schema) == []
    parsed = parse_spec(_default(copy.deepcopy(spec), spec_schema), CONFIG.default_image)
    assert parsed.autoscaling is not None and parsed.colocated.autoscaling == parsed.autoscaling
    assert (parsed.autoscaling.min_replicas, parsed.autoscaling.metric) == (1, "queuedRequests")
    assert parsed.autoscaling.scale_down.stabilization_window_s == 60
    assert parsed.autoscaling.scale_down.max_groups == 1  # the operator's default
    pd = {"disaggregation": {"prefill": {"autoscaling": {"maxReplicas": 2, "target": 4}},
                             "decode": {"autoscaling": {"maxReplicas": 3, "target": 0.7}}}}
    jsonschema.validate({"spec": pd}, schema)
    assert _undeclared(pd, spec_schema) == []
    prefill, decode = parse_spec(pd, CONFIG.default_image).roles()
    assert prefill.autoscaling is not None and prefill.autoscaling.metric == "queuedRequests"
    assert decode.autoscaling is not None and decode.autoscaling.metric == "kvCacheUsage"
    with pytest.raises(jsonschema.ValidationError, match="'target' is a required property"):
        jsonschema.validate({"spec": {"autoscaling": {"maxReplicas": 2}}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="is not one of"):
        jsonschema.validate({"spec": {"autoscaling": {"maxReplicas": 2, "target": 1,
                                                      "metric": "cpu"}}}, schema)


@pytest.mark.parametrize(("autoscaling", "field"), [
    ({"maxReplicas": 2, "target": 1, "metric": "cpu"}, "spec.autoscaling.metric"),
    ({"minReplicas": 3, "maxReplicas": 2, "target": 1}, "spec.autoscaling"),
    ({"maxReplicas": 2, "target": 0}, "spec.autoscaling.target"),
])
def test_a_bad_autoscaling_block_names_its_field(autoscaling: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_spec({"autoscaling": autoscaling}, CONFIG.default_image)


def test_the_autoscaling_status_is_declared(schema: dict[str, Any]) -> None:
    clock = Clock()
    api = FakeApi({"autoscaling": {"maxReplicas": 2, "target": 2}})
    api.converge(clock.now)
    api.signals = {"llm-0": EngineSignals((("queuedRequests", 6.0),))}
    api.step(clock.advance(15))
    assert api.status["autoscaling"][0]["lastDecision"]["to"] == 2
    assert _undeclared(api.status, schema["properties"]["status"]) == []
    jsonschema.validate(api.status, schema["properties"]["status"])
