"""Structured-output constraints checked before a request is queued: a JSON schema, regex or EBNF
grammar that xgrammar cannot read is a 400 naming the problem. The scheduler compiles the same
text against the tokenizer (shoal.scheduler.grammar)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import xgrammar as xgr

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # `response_format: {"type": "json_object"}`
# schema keywords whose values are data (instances), not schemas: a "$ref" in them is no reference
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(exc: Exception) -> str:
    """xgrammar's message without its source location."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NATIVE_PREFIX.sub("", first)


def check_json_schema(schema: dict[str, Any] | str) -> str:
    """The schema as the JSON text the scheduler compiles."""
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        refs = _external_refs(json.loads(text))
    except RecursionError as exc:
        raise ValueError("invalid JSON schema: nested too deeply") from exc
    except ValueError as exc:
        raise ValueError(f"invalid JSON schema: not JSON ({exc})") from exc
    if refs:
        raise ValueError(f"invalid JSON schema: only references within the schema (`#...`) are "
                         f"supported, not `{refs[0]}`")
    _compiles(lambda: xgr.Grammar.from_json_schema(text, any_whitespace=False),
              "invalid JSON schema")
    return text


def check_regex(regex: str) -> str:
    _compiles(lambda: xgr.Grammar.from_regex(regex), "invalid regular expression")
    return regex


def check_ebnf(ebnf: str) -> str:
    _compiles(lambda: xgr.Grammar.from_ebnf(ebnf), "invalid EBNF grammar")
    return ebnf


def _compiles(build: Callable[[], object], what: str) -> None:
    """Raise ValueError(`what`: the reason) when xgrammar cannot build the grammar."""
    try:
        build()
    except (RuntimeError, ValueError, TypeError, RecursionError) as exc:
        raise ValueError(f"{what}: {_reason(exc)}") from exc


def _external_refs(schema: Any) -> list[str]:
    """The `$ref`s of a schema that point outside it (another document, a URL)."""
    if isinstance(schema, list):
        return [ref for item in schema for ref in _external_refs(item)]
    if not isinstance(schema, dict):
        return []
    ref = schema.get("$ref")
    own = [ref] if isinstance(ref, str) and not ref.startswith("#") else []
    return own + [r for key, value in schema.items() if key not in DATA_KEYWORDS
                  for r in _external_refs(value)]
