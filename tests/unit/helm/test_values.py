"""The chart's values: the schema refuses wrong types and unknown keys by name, every key is
commented, the docs' table lists every key with its default, and the chart's appVersion is
shoal's version."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import shoal
from tests.support.helm import CHART, NAMESPACE, RELEASE, REPO, run_helm, values_args

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES_DOC = REPO / "docs" / "kubernetes.md"
_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z][\w-]*):")


def _template_error(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = run_helm("template", RELEASE, CHART, "--namespace", NAMESPACE,
                      *values_args([path]), check=False)
    assert result.returncode != 0, f"helm template accepted {values}:\n{result.stdout}"
    return result.stderr


@pytest.mark.parametrize(("values", "message"), [
    ({"image": {"tag": 7}}, "at '/image/tag': got number, want string"),
    ({"watchNamespaces": "team-a"}, "at '/watchNamespaces': got string, want array"),
    ({"health": {"port": "8080"}}, "at '/health/port': got string, want integer"),
    ({"rbac": {"create": "yes"}}, "at '/rbac/create': got string, want boolean"),
    ({"resources": {"limits": {"memory": ["1Gi"]}}}, "at '/resources/limits/memory'"),
    ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
    ({"operator": {"logLevel": "loud"}}, "at '/operator/logLevel'"),
    ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0'"),
])
def test_wrong_type_is_refused_naming_the_key(tmp_path: Path, values: dict[str, Any],
                                              message: str) -> None:
    error = _template_error(tmp_path, values)
    assert "values don't meet the specifications of the schema" in error
    assert message in error


@pytest.mark.parametrize(("values", "message"), [
    ({"replicaCount": 2}, "at '': additional properties 'replicaCount' not allowed"),
    ({"image": {"digest": "sha256:0"}}, "at '/image': additional properties 'digest' not allowed"),
    ({"rbac": {"create": True, "clusterWide": True}},
     "at '/rbac': additional properties 'clusterWide' not allowed"),
])
def test_unknown_key_is_refused_naming_it(tmp_path: Path, values: dict[str, Any],
                                          message: str) -> None:
    assert message in _template_error(tmp_path, values)


def _chart_keys(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of every key the schema declares (free-form Kubernetes objects are leaves)."""
    keys: list[str] = []
    for name, sub in schema.get("properties", {}).items():
        if name == "global":
            continue
        path = f"{prefix}{name}"
        keys.append(path)
        keys += _chart_keys(sub, path + ".")
    return keys


def _leaf_keys() -> list[str]:
    keys = _chart_keys(SCHEMA)
    return [key for key in keys if not any(other.startswith(key + ".") for other in keys)]


def _commented_keys(text: str) -> dict[str, bool]:
    """Dotted path of each key line of values.yaml -> whether a comment line is right above it."""
    found: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in text.splitlines():
        if (match := _KEY_LINE.match(line)) is not None:
            indent = len(match["indent"])
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, match["key"])]
            found[".".join(k for _, k in stack)] = previous.lstrip().startswith("#")
        previous = line
    return found


def test_every_key_of_values_yaml_is_commented() -> None:
    commented = _commented_keys(VALUES_TEXT)
    keys = _chart_keys(SCHEMA)
    assert set(keys) <= set(commented), f"not in values.yaml: {set(keys) - set(commented)}"
    assert [key for key in keys if not commented[key]] == []


def _get(values: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        values = values[part]
    return values


def test_docs_table_lists_every_key_with_its_default() -> None:
    rows = re.findall(r"^\| `([\w.]+)` \| [^|]+ \| `([^`]*)` \|", VALUES_DOC.read_text(),
                      re.MULTILINE)
    values = yaml.safe_load(VALUES_TEXT)
    assert [key for key, _ in rows] == _leaf_keys()
    for key, default in rows:
        assert yaml.safe_load(default) == _get(values, key), key


def test_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == shoal.__version__
