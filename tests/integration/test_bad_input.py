"""Acceptance: malformed or impossible requests get a 4xx OpenAI error; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.support.server import RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    ("bad-json", CHAT, b'{"messages": [', 400),
    ("not-an-object", CHAT, b'[1, 2, 3]', 400),
    ("missing-messages", CHAT, {"max_tokens": 5}, 400),
    ("empty-messages", CHAT, {"messages": []}, 400),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("max-tokens-wrong-type", CHAT, {"messages": HELLO, "max_tokens": "many"}, 400),
    ("negative-max-tokens", CHAT, {"messages": HELLO, "max_tokens": -5}, 400),
    ("negative-temperature", CHAT, {"messages": HELLO, "temperature": -1}, 400),
    ("top-p-above-one", CHAT, {"messages": HELLO, "top_p": 2}, 400),
    ("stop-wrong-type", CHAT, {"messages": HELLO, "stop": 7}, 400),
    ("unknown-model", CHAT, {"model": "no-such-model", "messages": HELLO}, 404),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 5}, 400),
    ("prompt-longer-than-context", COMPLETIONS, {"prompt": "hello " * 9000, "max_tokens": 5}, 400),
    ("max-tokens-beyond-context", COMPLETIONS, {"prompt": "hi", "max_tokens": 10_000_000}, 400),
    ("token-id-out-of-vocab", COMPLETIONS, {"prompt": [1, 2, 999_999_999], "max_tokens": 2}, 400),
    ("generate-without-input", "/generate", {"sampling_params": {"max_new_tokens": 2}}, 400),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error(default_server: RunningServer, name: str, path: str,
                                       body: object, status: int) -> None:
    with httpx.Client(base_url=default_server.base_url, timeout=60) as client:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["message"] and error["type"]
        assert "code" in error
        assert client.get("/health").status_code == 200
        ok = client.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# (name, route, body, the `param` of the 400): every constraint that does not compile
BAD_CONSTRAINTS = [
    ("schema-unknown-type", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema"),
    ("schema-dangling-ref", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/Missing"}}}},
     "response_format.json_schema.schema"),
    ("schema-external-ref", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "https://example.com/s.json"}}}},
     "response_format.json_schema.schema"),
    ("schema-min-above-max", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format.json_schema.schema"),
    ("schema-properties-not-an-object", CHAT, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "items": {"type": "array", "items": {"properties": 3}}}}}},
     "response_format.json_schema.schema"),
    ("tool-parameters-bad", CHAT, {"tools": [{**TOOL, "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}],
        "tool_choice": "required"}, "tools.0.function.parameters"),
    ("tool-parameters-enum-empty", CHAT, {"tools": [{**TOOL, "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"enum": []}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools.0.function.parameters"),
    ("regex-unbalanced", CHAT, {"regex": "(ab"}, "regex"),
    ("regex-bad-range", COMPLETIONS, {"prompt": "hi", "regex": "[z-a]"}, "regex"),
    ("regex-lookbehind", COMPLETIONS, {"prompt": "hi", "regex": "(?<=a)b"}, "regex"),
    ("ebnf-no-root", CHAT, {"ebnf": 'start ::= "a"'}, "ebnf"),
    ("ebnf-undefined-rule", COMPLETIONS, {"prompt": "hi", "ebnf": "root ::= foo"}, "ebnf"),
    ("native-schema-not-json", "/generate", {"text": "hi", "sampling_params": {
        "json_schema": "{not json"}}, "sampling_params.json_schema"),
    ("native-regex", "/generate", {"text": "hi", "sampling_params": {"regex": "a**"}},
     "sampling_params.regex"),
]


@pytest.mark.parametrize("name,path,body,param", BAD_CONSTRAINTS,
                         ids=[b[0] for b in BAD_CONSTRAINTS])
def test_a_constraint_that_does_not_compile_is_a_400_naming_it(
        default_server: RunningServer, name: str, path: str, body: dict, param: str) -> None:
    if path != "/generate":
        body = {"max_tokens": 4, **({"messages": HELLO} if path == CHAT else {}), **body}
    r = httpx.post(f"{default_server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
