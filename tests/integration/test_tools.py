"""Acceptance (issue 14): tool calls from the served default model through the official client.
With `tool_choice="required"` or a named function the calls always parse and their arguments
validate; a streamed call reassembles to the same call."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

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
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
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
