"""Tool-call parsing and the call schema (api/tool_calls.py): what becomes `message.tool_calls`."""

from __future__ import annotations

import enum
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from shoal.api.constraints import check_json_schema
from shoal.api.tool_calls import call_schema, parse_tool_calls, with_fallback_prompt

WEATHER = {"name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
NAMES = {"get_weather", "get_time"}


def calls_of(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, NAMES)
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


@pytest.mark.parametrize("text, expected", [
    ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     (None, [("get_weather", {"city": "Oslo"})])),
    ('{"name": "get_time", "arguments": {}}', (None, [("get_time", {})])),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     ("Let me check.", [("get_weather", {"city": "Rome"}), ("get_time", {})])),
    ('[{"name": "launch_rocket", "arguments": {}}]',
     ('[{"name": "launch_rocket", "arguments": {}}]', [])),
    ("<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),
    ("It is sunny.", ("It is sunny.", [])),
    ('[{"name": "get_time", "arguments": "x"}]', ('[{"name": "get_time", "arguments": "x"}]', [])),
])
def test_parse(text, expected):
    assert calls_of(text) == expected


def test_call_schema_accepts_calls_of_the_given_functions_only():
    schema = json.loads(call_schema([WEATHER, TIME], parallel=True))
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],
                [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(call_schema([TIME], parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, single)


def test_fallback_prompt_joins_the_system_message():
    functions = [WEATHER]
    alone = with_fallback_prompt([{"role": "user", "content": "Hi"}], functions)
    assert alone[0]["role"] == "system" and json.dumps(WEATHER) in alone[0]["content"]
    joined = with_fallback_prompt([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}], functions)
    assert len(joined) == 2 and joined[0]["content"].startswith("Be brief.\n\n")


class Location(BaseModel):
    city: str
    country: str | None = None


class Unit(enum.StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class GetWeather(BaseModel):
    location: Location
    unit: Unit


class Tree(BaseModel):
    label: str
    children: list[Tree] = []


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]


class Adopt(BaseModel):
    pet: Cat | Dog


# (parameters as pydantic or a client writes them, arguments they accept, arguments they refuse)
EMBEDDED = {
    "nested": (GetWeather.model_json_schema(),
               {"location": {"city": "Oslo", "country": None}, "unit": "celsius"},
               {"location": {"city": 3}, "unit": "celsius"}),
    "recursive": (Tree.model_json_schema(),
                  {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]},
                  {"label": "a", "children": [{"children": []}]}),
    "union": (Adopt.model_json_schema(), {"pet": {"kind": "cat", "lives": 9}},
              {"pet": {"kind": "fish"}}),
    "definitions-and-root": ({"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        "value": {"$ref": "#/definitions/Value"}}, "required": ["value"],
        "definitions": {"Value": {"type": "integer"}}},
        {"value": 1, "next": {"value": 2, "next": None}}, {"value": 1, "next": {"value": "x"}}),
    "pointer-into-itself": ({"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 3}, "b": {"$ref": "#/properties/a"}}},
        {"a": "x", "b": "abc"}, {"b": "abcd"}),
}


@pytest.mark.parametrize("name", list(EMBEDDED))
def test_call_schema_keeps_the_meaning_of_embedded_references(name: str) -> None:
    """Each function's `$ref`s, `$defs`, `definitions` and recursion mean inside the calls'
    schema what they mean on their own (jsonschema as the reference), and xgrammar compiles it."""
    parameters, good, bad = EMBEDDED[name]
    jsonschema.validate(good, parameters)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, parameters)
    text = call_schema([TIME, {"name": "f", "parameters": parameters}], parallel=True)
    check_json_schema(text)
    schema = json.loads(text)
    jsonschema.validate([{"name": "get_time", "arguments": {}}, {"name": "f", "arguments": good}],
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "arguments": bad}], schema)
