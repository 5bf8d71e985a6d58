"""Acceptance (issue 17): every field of every request model is honoured, accepted and ignored
(documented), or refused with a 400 that names it.

Each honoured field is sent with an example value and its effect is checked on what reaches the
(fake) engine or on the response; each ignored field leaves the engine's request as it was
without it; every refused field (`request_fields.REFUSED`), every field the official `openai`
client can send that a route does not declare, and unknown fields get a 400 with `param` = the
field. A field added to a model without a row here fails `test_every_field_is_classified`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsBase as CompletionParams
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import BaseModel

from shoal.api.constraints import JSON_OBJECT_SCHEMA
from shoal.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionDefinition,
    GenerateRequest,
    JsonSchemaFormat,
    NativeSampling,
    ResponseFormat,
    StreamOptions,
    Tool,
)
from shoal.api.request_fields import REFUSED
from shoal.api.responses_protocol import InputMessage, ResponsesRequest, TextConfig, TextFormat
from shoal.api.tool_calls import call_schema, with_fallback_prompt
from shoal.ipc.messages import BootstrapInfo, GenerateReq
from tests.support.fake_api import fake_api
from tests.support.fake_engine import WORDS

CHAT, COMPLETIONS, GENERATE, RESPONSES = ("/v1/chat/completions", "/v1/completions",
                                          "/generate", "/v1/responses")
MESSAGES = [{"role": "user", "content": "Say hello."}]
BASE = {CHAT: {"messages": MESSAGES, "max_tokens": 8},
        COMPLETIONS: {"prompt": "Hi", "max_tokens": 8},
        GENERATE: {"text": "Hi"}, RESPONSES: {"input": "Say hello."}}
ROUTE_OF: dict[type[BaseModel], str] = {
    ChatCompletionRequest: CHAT, CompletionRequest: COMPLETIONS, GenerateRequest: GENERATE,
    ResponsesRequest: RESPONSES}
SDK_PARAMS = {CHAT: ChatParams, COMPLETIONS: CompletionParams, RESPONSES: ResponseCreateParamsBase}
BOOTSTRAP = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}


@dataclass
class Sent:
    """What one request produced: the engine's requests, and the HTTP response."""

    reqs: list[GenerateReq]
    response: httpx.Response
    tokenizer: Any

    @property
    def req(self) -> GenerateReq:
        return self.reqs[-1]

    def body(self) -> dict[str, Any]:
        return self.response.json()

    def events(self) -> list[Any]:
        lines = [line.removeprefix("data: ") for line in self.response.text.splitlines()
                 if line.startswith("data: ")]
        return [line if line == "[DONE]" else json.loads(line) for line in lines]

    def prompt_is(self, messages: list[dict[str, str]], **template: Any) -> bool:
        options = template or {"add_generation_prompt": True}
        return self.req.input_ids == self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, **options)


Check = Callable[[Sent], bool]


def sampling(**expected: Any) -> Check:
    return lambda sent: all(getattr(sent.req.sampling, k) == v for k, v in expected.items())


def status(code: int) -> Check:
    return lambda sent: sent.response.status_code == code


def streamed(sent: Sent) -> bool:
    return sent.response.headers["content-type"].startswith("text/event-stream")


def bootstrapped(sent: Sent) -> bool:
    return sent.req.bootstrap == BootstrapInfo(host="10.0.0.1", port=8998, room=7)


def usage_last(sent: Sent) -> bool:
    return sent.events()[-2]["usage"]["completion_tokens"] == len(WORDS) + 1


def usage_on_every_output(sent: Sent) -> bool:
    counts = [e["usage"]["completion_tokens"] for e in sent.events()[:-1]
              if e["choices"] and e["choices"][0]["delta"].get("role") is None]
    return counts == list(range(1, len(WORDS) + 2))


OTHER = [{"role": "user", "content": "Other."}]
CONTINUED = [*OTHER, {"role": "assistant", "content": "Well, it"}]
YES_NO = 'root ::= "yes" | "no"'
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]
CALLED = [{"role": "user", "content": "Weather in Oslo?"},
          {"role": "assistant", "content": None, "tool_calls": [{
              "id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}]


def tools_prompt(functions: list[dict[str, Any]], messages: list[dict[str, Any]] = MESSAGES
                 ) -> Check:
    return lambda sent: sent.prompt_is(with_fallback_prompt(messages, functions))
SAMPLING: dict[str, tuple[Any, Check]] = {
    "temperature": (0.5, sampling(temperature=0.5)),
    "top_p": (0.5, sampling(top_p=0.5)),
    "top_k": (5, sampling(top_k=5)),
    "min_p": (0.1, sampling(min_p=0.1)),
    "stop": ([" world"], sampling(stop=[" world"])),
    "seed": (42, sampling(seed=42)),
    "ignore_eos": (True, sampling(ignore_eos=True)),
    "stop_token_ids": ([7], sampling(stop_token_ids=[7])),
    "skip_special_tokens": (False, sampling(skip_special_tokens=False)),
    "speculative": (False, sampling(speculative=False)),
    "frequency_penalty": (0.5, sampling(frequency_penalty=0.5)),
    "presence_penalty": (0.5, sampling(presence_penalty=0.5)),
    "repetition_penalty": (1.2, sampling(repetition_penalty=1.2)),
    "logit_bias": ({"17": 5.0}, sampling(logit_bias={17: 5.0})),
    "regex": ("[0-9]+", sampling(regex="[0-9]+")),
    "ebnf": (YES_NO, sampling(ebnf=YES_NO)),
}
BOOTSTRAPPED = {name: ({name: value, **BOOTSTRAP}, bootstrapped)
                for name, value in BOOTSTRAP.items()}
OPENAI: dict[str, tuple[dict[str, Any], Check]] = {
    **{name: ({name: value}, check) for name, (value, check) in SAMPLING.items()},
    **BOOTSTRAPPED,
    "model": ({"model": "gpt-unknown"}, status(404)),
    "max_tokens": ({"max_tokens": 3}, sampling(max_new_tokens=3)),
    "min_tokens": ({"min_tokens": 2}, sampling(min_new_tokens=2)),
    "n": ({"n": 2}, lambda sent: len(sent.reqs) == 2 and len(sent.body()["choices"]) == 2),
    "stream": ({"stream": True}, streamed),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, usage_last),
    "response_format": ({"response_format": {"type": "json_object"}},
                        sampling(json_schema=JSON_OBJECT_SCHEMA)),
}

# model -> field -> (a patch of the route's base body that sets the field, the check of its
# effect on the engine's requests or the response)
HONOURED: dict[type[BaseModel], dict[str, tuple[dict[str, Any], Check]]] = {
    ChatCompletionRequest: {
        **OPENAI,
        "messages": ({"messages": OTHER}, lambda sent: sent.prompt_is(OTHER)),
        "max_completion_tokens": ({"max_completion_tokens": 4}, sampling(max_new_tokens=4)),
        "logprobs": ({"logprobs": True}, lambda sent: sent.req.logprob is not None),
        "top_logprobs": ({"logprobs": True, "top_logprobs": 3},
                         lambda sent: sent.req.logprob.top_logprobs_num == 3),
        "tools": ({"tools": TOOLS}, tools_prompt([WEATHER])),
        "tool_choice": ({"tools": TOOLS, "tool_choice": "required"},
                        sampling(json_schema=call_schema([WEATHER], parallel=True))),
        "parallel_tool_calls": ({"tools": TOOLS, "tool_choice": "required",
                                 "parallel_tool_calls": False},
                                sampling(json_schema=call_schema([WEATHER], parallel=False))),
        "continue_final_message": ({"messages": CONTINUED, "continue_final_message": True},
                                   lambda sent: sent.prompt_is(
                                       CONTINUED, continue_final_message=True)),
        "add_generation_prompt": ({"add_generation_prompt": False},
                                  lambda sent: sent.prompt_is(MESSAGES,
                                                              add_generation_prompt=False)),
        # a variable the default model's template does not read leaves its prompt as it was
        "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}},
                                 lambda sent: sent.prompt_is(MESSAGES)),
    },
    CompletionRequest: {
        **OPENAI,
        "prompt": ({"prompt": [[5, 6], [7]]},
                   lambda sent: [r.input_ids for r in sent.reqs] == [[5, 6], [7]]),
        "echo": ({"echo": True}, lambda sent: sent.body()["choices"][0]["text"].startswith("Hi")),
        "logprobs": ({"logprobs": 2}, lambda sent: sent.req.logprob.top_logprobs_num == 2),
    },
    NativeSampling: {
        **{name: ({"sampling_params": {name: value, "max_new_tokens": 8}}, check)
           for name, (value, check) in SAMPLING.items()},
        "max_new_tokens": ({"sampling_params": {"max_new_tokens": 3}},
                           sampling(max_new_tokens=3)),
        "min_new_tokens": ({"sampling_params": {"min_new_tokens": 2}},
                           sampling(min_new_tokens=2)),
        "json_schema": ({"sampling_params": {"json_schema": json.dumps(SCHEMA)}},
                        sampling(json_schema=json.dumps(SCHEMA))),
    },
    GenerateRequest: {
        **BOOTSTRAPPED,
        "text": ({"text": "Other"},
                 lambda sent: sent.req.input_ids == sent.tokenizer.encode("Other")),
        "input_ids": ({"text": None, "input_ids": [9, 8]},
                      lambda sent: sent.req.input_ids == [9, 8]),
        "sampling_params": ({"sampling_params": {"max_new_tokens": 2}},
                            sampling(max_new_tokens=2)),
        "stream": ({"stream": True}, streamed),
        "rid": ({"rid": "my-field-rid"}, lambda sent: sent.req.rid == "my-field-rid"),
        "return_logprob": ({"return_logprob": True},
                           lambda sent: "output_token_logprobs" in sent.body()["meta_info"]),
        "top_logprobs_num": ({"return_logprob": True, "top_logprobs_num": 2},
                             lambda sent: sent.req.logprob.top_logprobs_num == 2),
        "logprob_start_len": ({"return_logprob": True, "logprob_start_len": 0},
                              lambda sent: sent.req.logprob.logprob_start_len == 0),
        "return_text_in_logprobs": (
            {"return_logprob": True, "return_text_in_logprobs": True},
            lambda sent: sent.body()["meta_info"]["output_token_logprobs"][0][2] is not None),
    },
    ResponsesRequest: {
        **BOOTSTRAPPED,
        "input": ({"input": "Other."}, lambda sent: sent.prompt_is(OTHER)),
        "model": ({"model": "gpt-unknown"}, status(404)),
        "instructions": ({"instructions": "Be brief."}, lambda sent: sent.prompt_is(
            [{"role": "system", "content": "Be brief."}, *MESSAGES])),
        "max_output_tokens": ({"max_output_tokens": 3}, sampling(max_new_tokens=3)),
        "temperature": ({"temperature": 0.5}, sampling(temperature=0.5)),
        "top_p": ({"top_p": 0.5}, sampling(top_p=0.5)),
        "stream": ({"stream": True}, streamed),
        "stream_options": ({"stream": True, "stream_options": {}}, streamed),
        "text": ({"text": {"format": {"type": "text"}}},
                 lambda sent: sent.body()["text"] == {"format": {"type": "text"}}),
    },
    # parts of requests, sent through the route that carries them (PARTS)
    ChatMessage: {
        "role": ({"messages": [{"role": "system", "content": "Other."}]},
                 lambda sent: sent.prompt_is([{"role": "system", "content": "Other."}])),
        "content": ({"messages": [{"role": "user", "content": [{"type": "text",
                                                                "text": "Other."}]}]},
                    lambda sent: sent.prompt_is(OTHER)),
        # the default model's template has no place for tools: calls become the content
        "tool_calls": ({"messages": CALLED[:2]}, lambda sent: sent.prompt_is([
            CALLED[0], {"role": "assistant",
                        "content": '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'}])),
        # ... nor for the call a tool message answers (templates that have are given it)
        "tool_call_id": ({"messages": CALLED}, status(200)),
    },
    Tool: {"type": ({"tools": TOOLS}, tools_prompt([WEATHER])),
           "function": ({"tools": TOOLS}, tools_prompt([WEATHER]))},
    FunctionDefinition: {
        "name": ({"tools": TOOLS}, tools_prompt([WEATHER])),
        "description": ({"tools": TOOLS}, tools_prompt([WEATHER])),
        "parameters": ({"tools": TOOLS}, tools_prompt([WEATHER])),
    },
    StreamOptions: {
        "include_usage": ({"stream": True, "stream_options": {"include_usage": True}},
                          usage_last),
        "continuous_usage_stats": ({"stream": True,
                                    "stream_options": {"continuous_usage_stats": True}},
                                   usage_on_every_output),
    },
    InputMessage: {
        "type": ({"input": [{"type": "message", **OTHER[0]}]}, lambda sent: sent.prompt_is(OTHER)),
        "role": ({"input": [{"role": "developer", "content": "Other."}]},
                 lambda sent: sent.prompt_is([{"role": "system", "content": "Other."}])),
        "content": ({"input": [{"role": "user", "content": [{"type": "input_text",
                                                             "text": "Other."}]}]},
                    lambda sent: sent.prompt_is(OTHER)),
    },
    ResponseFormat: {
        "type": ({"response_format": {"type": "text"}}, sampling(json_schema=None)),
        "json_schema": ({"response_format": SCHEMA_FORMAT},
                        sampling(json_schema=json.dumps(SCHEMA))),
    },
    JsonSchemaFormat: {"schema": ({"response_format": SCHEMA_FORMAT},
                                  sampling(json_schema=json.dumps(SCHEMA)))},
    TextConfig: {"format": ({"text": {"format": {"type": "text"}}}, status(200))},
    TextFormat: {"type": ({"text": {"format": {"type": "text"}}}, status(200))},
}
# a part of a request: its route, a body patch with field (name, value) set, and the same
# patch without the field
Place = Callable[[str, Any], dict[str, Any]]
PARTS: dict[type[BaseModel], tuple[str, Place, dict[str, Any]]] = {
    NativeSampling: (GENERATE, lambda name, value: {"sampling_params": {name: value}}, {}),
    ChatMessage: (CHAT, lambda name, value: {"messages": [{**MESSAGES[0], name: value}]}, {}),
    StreamOptions: (CHAT, lambda name, value: {"stream": True, "stream_options": {name: value}},
                    {"stream": True, "stream_options": {}}),
    InputMessage: (RESPONSES, lambda name, value: {"input": [{**MESSAGES[0], name: value}]},
                   {"input": MESSAGES}),
    ResponseFormat: (CHAT, lambda name, value: {"response_format": {name: value}}, {}),
    Tool: (CHAT, lambda name, value: {"tools": [{**TOOLS[0], name: value}]}, {"tools": TOOLS}),
    FunctionDefinition: (CHAT, lambda name, value: {"tools": [{"type": "function", "function": {
        **WEATHER, name: value}}]}, {"tools": TOOLS}),
    JsonSchemaFormat: (CHAT, lambda name, value: {"response_format": {
        "type": "json_schema", "json_schema": {"schema": SCHEMA, name: value}}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}),
    TextConfig: (RESPONSES, lambda name, value: {"text": {name: value}}, {"text": {}}),
    TextFormat: (RESPONSES, lambda name, value: {"text": {"format": {name: value}}}, {}),
}
# example values of the ignored fields
IGNORED_VALUES = {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                  "safety_identifier": "s1", "prompt_cache_key": "k1",
                  "prompt_cache_retention": "24h", "include_obfuscation": True, "name": "bob",
                  "refusal": "no", "annotations": [], "parallel_tool_calls": False,
                  "id": "msg_1", "status": "completed", "phase": "final_answer",
                  "description": "a schema", "strict": True}


def field_names(model: type[BaseModel]) -> set[str]:
    """The names a request spells its fields with (an alias when the field has one)."""
    return {field.alias or name for name, field in model.model_fields.items()}


def route_of(model: type[BaseModel]) -> str:
    return PARTS[model][0] if model in PARTS else ROUTE_OF[model]


@pytest.fixture(scope="module")
def api(tokenizer):
    with fake_api(tokenizer) as running:
        yield running


@pytest.fixture(scope="module")
def send(api, tokenizer) -> Callable[[str, dict[str, Any]], Sent]:
    def send(route: str, patch: dict[str, Any]) -> Sent:
        body = {k: v for k, v in {**BASE[route], **patch}.items() if v is not None}
        before = len(api.engine.received)
        response = httpx.post(f"{api.url}{route}", json=body, timeout=10)
        reqs = [m for m in list(api.engine.received)[before:] if isinstance(m, GenerateReq)]
        return Sent(reqs, response, tokenizer)

    return send


def test_every_field_is_classified():
    for model in HONOURED:
        fields = field_names(model)
        ignored = model.ignored_fields
        assert not ignored & set(HONOURED[model]), model.__name__
        assert fields == set(HONOURED[model]) | ignored, (
            f"{model.__name__}: unclassified {fields - set(HONOURED[model]) - ignored}, "
            f"stale {set(HONOURED[model]) | ignored - fields}")


CASES = [(model, name) for model, fields in HONOURED.items() for name in fields]


@pytest.mark.parametrize("model, name", CASES, ids=[f"{m.__name__}.{n}" for m, n in CASES])
def test_honoured_field_has_its_effect(send, model, name):
    patch, check = HONOURED[model][name]
    sent = send(route_of(model), patch)
    assert sent.response.status_code in (200, 404), sent.response.text
    assert check(sent), (name, sent.response.text[:500])


IGNORED = [(model, name) for model in HONOURED for name in sorted(model.ignored_fields)]


@pytest.mark.parametrize("model, name", IGNORED, ids=[f"{m.__name__}.{n}" for m, n in IGNORED])
def test_ignored_field_changes_nothing(send, model, name):
    route, place, without = PARTS.get(model, (ROUTE_OF.get(model), lambda n, v: {n: v}, {}))
    baseline = send(route, without)
    sent = send(route, place(name, IGNORED_VALUES[name]))
    assert sent.response.status_code == baseline.response.status_code == 200, sent.response.text
    assert (sent.req.input_ids, sent.req.sampling, sent.req.logprob) == (
        baseline.req.input_ids, baseline.req.sampling, baseline.req.logprob)


def refused_cases() -> list[tuple[str, str]]:
    """(route, field) for each field a route refuses: REFUSED's, an unknown one, and every
    parameter of the official client's create() that the route does not declare."""
    declared = {route: set(model.model_fields) for model, route in ROUTE_OF.items()}
    names = {route: set(REFUSED) | {"frobnicate"} for route in BASE}
    for route, params in SDK_PARAMS.items():
        names[route] |= set(params.__annotations__)
    return sorted((route, name) for route in BASE for name in names[route] - declared[route])


@pytest.mark.parametrize("route, name", refused_cases())
def test_refused_field_is_a_400_naming_it(send, route, name):
    sent = send(route, {name: {"asks": "something"}})
    assert sent.response.status_code == 400, sent.response.text
    error = sent.body()["error"]
    assert error["param"] == name and name in error["message"], error
    assert not sent.reqs


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_field_asking_nothing_is_dropped(api, name):
    for value in (None, *REFUSED[name].no_ops):
        response = httpx.post(f"{api.url}{GENERATE}", timeout=10,
                              json={"text": "Hi", name: value} if name != "n" else
                              {"text": "Hi", "sampling_params": {name: value}})
        assert response.status_code == 200, (name, value, response.text)


@pytest.mark.parametrize("route, patch, param", [
    (CHAT, {"messages": [{**MESSAGES[0], "wizard": 1}]}, "messages.0.wizard"),
    (CHAT, {"stream": True, "stream_options": {"include_obfuscation": True, "wizard": 1}},
     "stream_options.wizard"),
    (GENERATE, {"sampling_params": {"json_mode": True}}, "sampling_params.json_mode"),
    (GENERATE, {"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
    (RESPONSES, {"input": [{**MESSAGES[0], "wizard": 1}]}, "input.0.wizard"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
     "messages"),
])
def test_refused_field_inside_a_part(send, route, patch, param):
    sent = send(route, patch)
    assert sent.response.status_code == 400, sent.response.text
    assert sent.body()["error"]["param"] == param


def test_docs_name_every_field():
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    named = {name for model in HONOURED for name in field_names(model)} | set(REFUSED)
    assert not {name for name in named if f"`{name}`" not in text}
