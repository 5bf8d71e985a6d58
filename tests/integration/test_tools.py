"""Acceptance (issue 14): tool calls from the served default model through the official client.
With `tool_choice="required"` or a named function the calls always parse and their arguments
validate; a streamed call reassembles to the same call. Tools made from pydantic models (nested,
recursive, unions, optional fields, enums) are called with arguments their models accept."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from typing import Literal

import jsonschema
import pytest
from openai import OpenAI, pydantic_function_tool
from pydantic import BaseModel, Field

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "Get the local time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                 "maxLength": 12}},
                       "required": ["zone"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def model_name(openai_client: OpenAI) -> str:
    return openai_client.models.list().data[0].id


def check_calls(calls: list, allowed: set[str]) -> list[tuple[str, dict]]:
    assert calls
    parsed = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        parsed.append((call.function.name, arguments))
    return parsed


def streamed_calls(client: OpenAI, kwargs: dict) -> tuple[dict[int, dict], list[str]]:
    """The calls of a streamed chat completion, each reassembled from its deltas by its index,
    and the finish reasons seen."""
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return calls, finishes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_calls_always_parse(openai_client: OpenAI, model_name: str,
                                               temperature: float) -> None:
    for choice, allowed in (("required", {"get_weather", "get_time"}),
                            ({"type": "function", "function": {"name": "get_time"}},
                             {"get_time"})):
        r = openai_client.chat.completions.create(
            model=model_name, messages=MESSAGES, tools=TOOLS, tool_choice=choice, n=2, seed=1,
            temperature=temperature, max_tokens=120)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            check_calls(c.message.tool_calls, allowed)


def test_streamed_call_reassembles_to_the_same_call(openai_client: OpenAI,
                                                    model_name: str) -> None:
    kwargs = {"model": model_name, "messages": MESSAGES, "tools": TOOLS,
              "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
              "max_tokens": 120}
    whole = openai_client.chat.completions.create(**kwargs)
    calls, finishes = streamed_calls(openai_client, kwargs)
    assert finishes == ["tool_calls"]
    expected = check_calls(whole.choices[0].message.tool_calls, {"get_weather", "get_time"})
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected


def test_tool_results_continue_the_conversation(openai_client: OpenAI, model_name: str) -> None:
    first = openai_client.chat.completions.create(
        model=model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    follow = openai_client.chat.completions.create(
        model=model_name, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20,
        messages=[*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}])
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


# ---- tools defined with pydantic (issue 51): `$defs` / `$ref`, recursion, unions, enums ----------


class Unit(enum.StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Location(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


class GetWeather(BaseModel):
    """A nested model: its parameters hold `$defs` and `"$ref": "#/$defs/Location"`."""

    location: Location
    unit: Unit
    days: int | None = Field(None, ge=1, le=7)


class Tree(BaseModel):
    """A recursive model."""

    label: str = Field(max_length=8)
    children: list[Tree] = Field(default_factory=list, max_length=2)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Adopt(BaseModel):
    """A union (`anyOf` of two `$ref`s) and an optional field."""

    pet: Cat | Dog
    note: str | None = Field(None, max_length=16)


PYDANTIC_TOOLS = {model.__name__: model for model in (GetWeather, Tree, Adopt)}
PROMPTS = {"GetWeather": "What is the weather in Paris, France, in celsius?",
           # greedy, a small model may nest children without end: ask for a finite tree (the
           # grammar's recursion itself: tests/unit/test_tool_calls.py)
           "Tree": "Make a tree with a root labelled 'a' and no children.",
           "Adopt": "Adopt a cat with 9 lives."}


def pydantic_tools(names: Iterable[str] = PYDANTIC_TOOLS) -> list[dict]:
    """Each model as the official client's helper makes it (strict: every field required,
    `additionalProperties: false`), and as pydantic's own schema (`{name}_plain`)."""
    tools = []
    for name in names:
        model = PYDANTIC_TOOLS[name]
        tools += [pydantic_function_tool(model),
                  {"type": "function", "function": {"name": f"{name}_plain",
                                                    "parameters": model.model_json_schema()}}]
    return tools


def validated(name: str, arguments: str) -> BaseModel:
    return PYDANTIC_TOOLS[name.removesuffix("_plain")].model_validate_json(arguments)


@pytest.mark.parametrize("name", [*PYDANTIC_TOOLS, *(f"{n}_plain" for n in PYDANTIC_TOOLS)])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_pydantic_tool_calls_validate(openai_client: OpenAI, model_name: str, name: str,
                                      choice: str) -> None:
    """Named: any of the tools may be offered, this one is called. Required: this model's two
    tools are offered, one of them is called."""
    model = name.removesuffix("_plain")
    tools = pydantic_tools() if choice == "named" else pydantic_tools([model])
    tool_choice = ({"type": "function", "function": {"name": name}} if choice == "named"
                   else "required")
    r = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": PROMPTS[model]}], tools=tools,
        tool_choice=tool_choice, parallel_tool_calls=False, temperature=0, max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == name if choice == "named" else call.function.name in {
        model, f"{model}_plain"}
    validated(call.function.name, call.function.arguments)


def test_pydantic_tools_streamed_parallel_calls_validate(openai_client: OpenAI,
                                                         model_name: str) -> None:
    kwargs = {"model": model_name, "tools": pydantic_tools(["GetWeather", "Adopt"]),
              "messages": [{"role": "user", "content": "What is the weather in Paris and in "
                                                       "Rome? Also adopt a dog."}],
              "tool_choice": "required", "parallel_tool_calls": True, "temperature": 0,
              "max_tokens": 400}
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    expected = [(c.function.name, validated(c.function.name, c.function.arguments))
                for c in whole.message.tool_calls]
    calls, _ = streamed_calls(openai_client, kwargs)
    assert [(c["name"], validated(c["name"], c["arguments"])) for c in calls.values()] == expected
