"""Acceptance (issue 14): structured outputs from the served default model, through the official
client. Every finished output of 50 JSON schemas x 4 prompts validates (greedy and at
temperature 1.0); regex and EBNF constraints hold; `parse()` with a pydantic model works; and
unconstrained requests running beside constrained ones are unaffected."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal

import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI
from pydantic import BaseModel, Field

from tests.support.schemas import json_schemas

PROMPTS = ["Describe a user profile as JSON.", "Give me data about a city in JSON.",
           "Write a JSON record for an online order.", "Return the app settings as JSON."]
MAX_TOKENS = 400
# (constraint, an independent check of a finished output)
# bounded, so that a small model's output ends within max_tokens
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
           r"[0-9]{1,4}\.[0-9]{2}", r"#[0-9a-f]{6}", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"]
EBNFS = {'root ::= "yes" | "no" | "maybe"': r"(yes|no|maybe)",
         'root ::= "(" [0-9]{1,3} ", " [0-9]{1,3} ")"': r"\([0-9]{1,3}, [0-9]{1,3}\)",
         'root ::= item (", " item){0,3}\nitem ::= "red" | "green" | "blue"':
             r"(red|green|blue)(, (red|green|blue)){0,3}",
         'root ::= [A-Z] [a-z]{0,8} " is " ("big" | "small")': r"[A-Z][a-z]{0,8} is (big|small)"}
GRAMMAR_PROMPTS = ["Answer the question: is the sky blue?", "Write something for me:"]


@pytest.fixture(scope="module")
def model_name(openai_client: OpenAI) -> str:
    return openai_client.models.list().data[0].id


def run_all(openai_client: OpenAI, requests: list[dict[str, Any]]) -> list[Any]:
    """Every request at once, as chat completions, in order."""
    async def run() -> list[Any]:
        client = AsyncOpenAI(base_url=str(openai_client.base_url), api_key="unused",
                             max_retries=0, timeout=1800)
        async with client:
            return await asyncio.gather(*(client.chat.completions.create(**r)
                                          for r in requests))

    return asyncio.run(run())


@pytest.mark.timeout(1200)  # 200 generations at once: about a minute on a quiet machine
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema(openai_client: OpenAI, model_name: str,
                                                   temperature: float) -> None:
    cases = [(schema, prompt) for schema in json_schemas() for prompt in PROMPTS]
    responses = run_all(openai_client, [
        {"model": model_name, "messages": [{"role": "user", "content": prompt}],
         "temperature": temperature, "seed": i, "max_tokens": MAX_TOKENS,
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": "record", "schema": schema, "strict": True}}}
        for i, (schema, prompt) in enumerate(cases)])
    for (schema, _), response in zip(cases, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_and_ebnf_constraints_hold(openai_client: OpenAI, model_name: str) -> None:
    cases = [({"regex": r}, r) for r in REGEXES] + [({"ebnf": g}, r) for g, r in EBNFS.items()]
    requests = [{"model": model_name, "messages": [{"role": "user", "content": prompt}],
                 "temperature": temperature, "seed": 3, "max_tokens": 60, "extra_body": body}
                for body, _ in cases for prompt in GRAMMAR_PROMPTS for temperature in (0.0, 1.0)]
    checks = [check for _, check in cases for _ in GRAMMAR_PROMPTS for _ in (0.0, 1.0)]
    for check, response in zip(checks, run_all(openai_client, requests)):
        choice = response.choices[0]
        assert choice.finish_reason == "stop" and re.fullmatch(check, choice.message.content), (
            check, choice.message.content)


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=50_000_000)
    size: Literal["small", "medium", "large"]
    landmarks: list[str] = Field(min_length=1, max_length=3)


def test_client_parse_and_json_mode(openai_client: OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Describe Paris."}]
    parsed = openai_client.beta.chat.completions.parse(
        model=model_name, messages=messages, response_format=City, temperature=0,
        max_tokens=MAX_TOKENS)
    assert isinstance(parsed.choices[0].message.parsed, City)
    mode = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=MAX_TOKENS)
    assert isinstance(json.loads(mode.choices[0].message.content), dict)
    with pytest.raises(BadRequestError) as info:
        openai_client.chat.completions.create(
            model=model_name, messages=messages, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    assert info.value.body["param"] == "response_format.json_schema.schema"
    assert "foo" in info.value.body["message"]


def test_unconstrained_requests_beside_constrained_ones_are_unaffected(
        openai_client: OpenAI, model_name: str) -> None:
    plain = [{"model": model_name, "messages": [{"role": "user", "content": prompt}],
              "temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
             for prompt in PROMPTS]
    alone = [r.choices[0].message.content for r in run_all(openai_client, plain)]
    constrained = [{"model": model_name, "messages": [{"role": "user", "content": prompt}],
                    "temperature": 1.0, "max_tokens": 48,
                    "response_format": {"type": "json_object"}} for prompt in PROMPTS]
    together = run_all(openai_client, constrained + plain + constrained)
    assert [r.choices[0].message.content for r in together[4:8]] == alone
