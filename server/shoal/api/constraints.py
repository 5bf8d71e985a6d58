"""Structured-output constraints checked before a request is queued: a JSON schema, regex or EBNF
grammar that xgrammar cannot read is a 400 naming the problem. The scheduler compiles the same
text against the tokenizer (shoal.scheduler.grammar)."""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # `response_format: {"type": "json_object"}`
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(exc: Exception) -> str:
    """xgrammar's message without its source location."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NATIVE_PREFIX.sub("", first)


def check_json_schema(schema: dict[str, Any] | str) -> str:
    """The schema as the JSON text the scheduler compiles."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        xgr.Grammar.from_json_schema(text, any_whitespace=False)
    except RuntimeError as exc:
        raise ValueError(f"invalid JSON schema: {_reason(exc)}") from exc
    return text


def check_regex(regex: str) -> str:
    try:
        xgr.Grammar.from_regex(regex)
    except RuntimeError as exc:
        raise ValueError(f"invalid regular expression: {_reason(exc)}") from exc
    return regex


def check_ebnf(ebnf: str) -> str:
    try:
        xgr.Grammar.from_ebnf(ebnf)
    except RuntimeError as exc:
        raise ValueError(f"invalid EBNF grammar: {_reason(exc)}") from exc
    return ebnf
