"""`/v1/responses` over the real api process and a fake engine, driven by the official client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from shoal.api.responses_protocol import ResponseObject
from shoal.api.responses_serving import ResponsesServing
from shoal.ipc.messages import FinishReason, ReqStrOut
from tests.support.fake_api import MODEL, fake_api
from tests.support.fake_engine import WORDS

FULL_TEXT = "".join(WORDS)


@pytest.fixture(scope="module")
def api(tokenizer):
    with fake_api(tokenizer) as running:
        yield running


@pytest.fixture
def client(api):
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)


def chat_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def sent(api, response_id):
    return api.engine.generate_reqs()[response_id.removeprefix("resp_")]


def test_create(client, api, tokenizer):
    resp = client.responses.create(model=MODEL, input="Say hello.", temperature=0.3, top_p=0.9,
                                   metadata={"k": "v"}, user="u1", store=True)
    assert resp.object == "response" and resp.status == "completed" and resp.model == MODEL
    assert resp.output_text == FULL_TEXT
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.content[0].type == "output_text"
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Say hello."}])
    assert resp.usage.input_tokens == len(ids)
    assert resp.usage.output_tokens == len(WORDS) + 1
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.input_tokens_details.cached_tokens == len(ids) // 2
    assert resp.metadata == {"k": "v"} and resp.store is False
    req = sent(api, resp.id)
    assert req.input_ids == ids
    assert (req.sampling.temperature, req.sampling.top_p) == (0.3, 0.9)


def test_instructions_and_message_list(client, api, tokenizer):
    first = client.responses.create(model=MODEL, input="Say hello.")
    history = [{"role": "user", "content": "Say hello."},
               first.output[0].model_dump(exclude_none=True),
               {"role": "developer", "content": [{"type": "input_text", "text": "Again."}]}]
    resp = client.responses.create(model=MODEL, input=history, instructions="Be brief.")
    expected = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": FULL_TEXT},
                {"role": "system", "content": "Again."}]
    assert sent(api, resp.id).input_ids == chat_ids(tokenizer, expected)
    assert resp.instructions == "Be brief."


def test_max_output_tokens_makes_it_incomplete(client, api):
    resp = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=2)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "".join(WORDS[:2]) and resp.output[0].status == "incomplete"
    assert sent(api, resp.id).sampling.max_new_tokens == 2


def test_stream_event_sequence(client):
    events = list(client.responses.create(model=MODEL, input="Say hello.", stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + [d.type for d in deltas]
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == FULL_TEXT
    assert len({d.item_id for d in deltas}) == 1 and events[-2].item.id == deltas[0].item_id
    final = events[-1].response
    assert final.output_text == FULL_TEXT and final.usage.output_tokens == len(WORDS) + 1
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_stream_helper_and_incomplete_stream(client):
    with client.responses.stream(model=MODEL, input="Say hello.") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == FULL_TEXT
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True,
                                          max_output_tokens=1))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "input"),
    ({"input": "hi", "previous_response_id": "resp_x"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options"),
])
def test_bad_request_gets_an_openai_error(api, body, param):
    response = httpx.post(f"{api.url}/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_bad_request_via_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert "not stored" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-unknown", input="hi")


def test_engine_abort_fails_the_stream():
    async def outputs() -> AsyncIterator[ReqStrOut]:
        yield ReqStrOut(rid="r", text="Hel", new_ids=[1], finish=None, prompt_tokens=3,
                        completion_tokens=1, cached_tokens=0)
        yield ReqStrOut(rid="r", text="", new_ids=[], prompt_tokens=3, completion_tokens=1,
                        cached_tokens=0, finish=FinishReason(kind="abort", message="no room"))

    async def collect() -> list[dict]:
        base = ResponseObject(id="resp_r", created_at=0, status="in_progress", model=MODEL)
        return [e async for e in ResponsesServing(None)._events(base, outputs())]

    events = asyncio.run(collect())
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "no room"
