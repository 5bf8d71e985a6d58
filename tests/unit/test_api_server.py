"""The api process end to end over real HTTP: uvicorn + TokenizerManager + a fake engine.

Driven with the official `openai` client and httpx; the fake engine (fake_engine.py) plays the
scheduler and detokenizer over the real ZMQ sockets.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import httpx
import openai
import pytest
import zmq

from tests.unit.fake_engine import ABORT_SEED, EOS_ID, WORDS, FakeEngine, ServerThread
from shoal import model_store
from shoal.api.http_server import create_app
from shoal.api.tokenizer_manager import TokenizerManager
from shoal.config import ComponentArgs, ServerArgs
from shoal.ipc import sockets
from shoal.ipc.messages import AbortReq, BatchStrOut, ReqStrOut
from shoal.tokenizer import load_tokenizer

MODEL = "smol-test"
CONTEXT = 4096
API_KEY = "sk-test-123"
FULL_TEXT = "".join(WORDS)
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(model_store.prepare()))


def start_server(tokenizer, api_key=None, send_ready=True):
    run_dir = tempfile.mkdtemp(prefix="shoal-api-")
    args = ServerArgs(served_model_name=MODEL, api_key=api_key)
    tm = TokenizerManager(args, ComponentArgs(run_dir=run_dir), tokenizer, disconnect_poll_s=0.05)
    engine = FakeEngine(run_dir, context_length=CONTEXT, send_ready=send_ready).start()
    server = ServerThread(create_app(args, tm)).start()
    deadline = time.monotonic() + 5
    while send_ready and not tm.is_ready:
        assert time.monotonic() < deadline, "api never saw the components ready"
        time.sleep(0.01)
    return server, engine, tm


@pytest.fixture(scope="module")
def served(tokenizer):
    server, engine, tm = start_server(tokenizer)
    yield server, engine, tm
    server.stop()
    engine.stop()


@pytest.fixture
def url(served):
    return served[0].url


@pytest.fixture
def engine(served):
    return served[1]


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def prompt_len(tokenizer, messages=MESSAGES):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def sse_events(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- OpenAI chat ---------------------------------------------------------------------------------


def test_chat_completion(client, engine, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content == FULL_TEXT
    assert choice.finish_reason == "stop"
    assert resp.usage.prompt_tokens == prompt_len(tokenizer)
    assert resp.usage.completion_tokens == len(WORDS) + 1  # the words and EOS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == prompt_len(tokenizer) // 2
    req = engine.generate_reqs()[resp.id.removeprefix("chatcmpl-")]
    assert req.sampling.temperature == 0 and req.sampling.max_new_tokens == CONTEXT - len(
        req.input_ids)
    assert req.input_ids == tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert choice.model_extra["matched_stop"] == EOS_ID


def test_chat_length_and_extensions(client, engine):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3,
        extra_body={"top_k": 5, "min_p": 0.2, "stop_token_ids": [7], "ignore_eos": True})
    assert resp.choices[0].message.content == "".join(WORDS[:3])
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3
    sampling = engine.generate_reqs()[resp.id.removeprefix("chatcmpl-")].sampling
    assert (sampling.max_new_tokens, sampling.top_k, sampling.min_p) == (3, 5, 0.2)
    assert sampling.stop_token_ids == [7] and sampling.ignore_eos


def test_chat_stop_string(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=[" world", "zz"])
    assert resp.choices[0].message.content == "Hello,"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["matched_stop"] == " world"


@pytest.mark.parametrize("max_tokens, finish", [(None, "stop"), (2, "length")])
def test_chat_stream(client, tokenizer, max_tokens, finish):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            max_tokens=max_tokens,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f is not None] == [finish]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (FULL_TEXT if max_tokens is None else "".join(WORDS[:max_tokens]))
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.prompt_tokens == prompt_len(tokenizer)
    assert usage_chunk.usage.completion_tokens == (max_tokens or len(WORDS) + 1)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_chat_stream_raw_sse(url):
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_chat_content_parts_and_developer_role(client, tokenizer):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say "},
                                             {"type": "text", "text": "hello."}]}]
    resp = client.chat.completions.create(model=MODEL, messages=messages)
    expected = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello."}]
    assert resp.usage.prompt_tokens == prompt_len(tokenizer, expected)


# ---- OpenAI completions --------------------------------------------------------------------------


def test_completion(client, tokenizer):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert resp.object == "text_completion" and resp.choices[0].text == "".join(WORDS[:4])
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    assert resp.usage.completion_tokens == 4


def test_completion_token_ids_and_echo(client, tokenizer):
    ids = tokenizer.encode("The sky is")
    resp = client.completions.create(model=MODEL, prompt=ids, echo=True)
    assert resp.choices[0].text == tokenizer.decode(ids) + FULL_TEXT
    assert resp.choices[0].finish_reason == "stop" and resp.usage.prompt_tokens == len(ids)


def test_completion_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", stream=True, max_tokens=10,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == FULL_TEXT and [f for f in finishes if f] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(WORDS) + 1


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == CONTEXT
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-unknown")


# ---- native and operational routes ---------------------------------------------------------------


def test_generate_native(url, tokenizer):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    out = httpx.post(f"{url}/generate", json=body, timeout=10).json()
    assert out["text"] == "".join(WORDS[:3]) and len(out["output_ids"]) == 3
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(tokenizer.encode("Hello"))
    assert meta["completion_tokens"] == 3 and meta["finish_reason"]["type"] == "length"
    assert meta["cached_tokens"] == meta["prompt_tokens"] // 2 and meta["e2e_latency"] > 0
    out = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3]}, timeout=10).json()
    assert out["text"] == FULL_TEXT
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}


def test_generate_native_stream(url):
    body = {"input_ids": [5, 6], "stream": True, "sampling_params": {"stop": [" world"]}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=10) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert texts[-1] == "Hello," and texts == sorted(texts, key=len)  # cumulative
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": " world"}


def test_health_and_server_info(url):
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    info = httpx.get(f"{url}/server_info").json()
    assert info["served_model_name"] == MODEL and info["version"]
    assert info["limits"] == {"context_length": CONTEXT, "max_total_tokens": 2 * CONTEXT,
                              "max_running_requests": 8}
    assert info["ready_components"] == ["detokenizer", "scheduler"]
    assert info["scheduler"] == {"num_free_slots": 7}


def test_flush_cache_route(url):
    r = httpx.post(f"{url}/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True


def test_concurrent_requests_are_routed(url):
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            bodies = [{"input_ids": [9], "sampling_params": {"max_new_tokens": n}}
                      for n in range(1, 9)]
            return await asyncio.gather(*(http.post("/generate", json=b) for b in bodies))

    for n, response in enumerate(asyncio.run(run()), start=1):
        assert response.json()["text"] == "".join(WORDS[:n])
        assert response.json()["meta_info"]["completion_tokens"] == min(n, len(WORDS) + 1)


# ---- bad input -----------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_PROMPT = list(range(10, 10 + CONTEXT + 5))

BAD_REQUESTS = {
    "bad json": (CHAT, b'{"messages": [', 400),
    "body not an object": (CHAT, [1, 2], 400),
    "max_tokens wrong type": (CHAT, {"messages": MESSAGES, "max_tokens": "ten"}, 400),
    "negative max_tokens": (CHAT, {"messages": MESSAGES, "max_tokens": -5}, 400),
    "zero max_tokens": (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400),
    "temperature -1": (CHAT, {"messages": MESSAGES, "temperature": -1}, 400),
    "top_p 2": (CHAT, {"messages": MESSAGES, "top_p": 2}, 400),
    "top_k -3": (CHAT, {"messages": MESSAGES, "top_k": -3}, 400),
    "min_p 1.5": (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, 400),
    "prompt too long": (COMPLETIONS, {"prompt": LONG_PROMPT}, 400),
    "prompt too long, streaming": (COMPLETIONS, {"prompt": LONG_PROMPT, "stream": True}, 400),
    "max_tokens past context": (CHAT, {"messages": MESSAGES, "max_tokens": CONTEXT}, 400),
    "empty messages": (CHAT, {"messages": []}, 400),
    "missing messages": (CHAT, {"model": MODEL}, 400),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "image content": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
    "n=2": (CHAT, {"messages": MESSAGES, "n": 2}, 400),
    "logprobs": (CHAT, {"messages": MESSAGES, "logprobs": True}, 400),
    "unknown model": (CHAT, {"messages": MESSAGES, "model": "gpt-4o"}, 404),
    "missing prompt": (COMPLETIONS, {"max_tokens": 3}, 400),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400),
    "two prompts": (COMPLETIONS, {"prompt": ["a", "b"]}, 400),
    "token id out of vocabulary": (COMPLETIONS, {"prompt": [1, 10**9]}, 400),
    "negative token id": (COMPLETIONS, {"prompt": [-1]}, 400),
    "stop not str or list": (CHAT, {"messages": MESSAGES, "stop": 5}, 400),
    "five stop strings": (CHAT, {"messages": MESSAGES, "stop": list("abcde")}, 400),
    "stop_token_ids out of vocabulary": (CHAT, {"messages": MESSAGES,
                                                "stop_token_ids": [10**7]}, 400),
    "seed too large": (CHAT, {"messages": MESSAGES, "seed": 2**70}, 400),
    "generate text and input_ids": ("/generate", {"text": "a", "input_ids": [1]}, 400),
    "generate without input": ("/generate", {"sampling_params": {}}, 400),
    "generate bad sampling": ("/generate", {"text": "a",
                                            "sampling_params": {"max_new_tokens": "x"}}, 400),
    "unknown route": ("/v1/nope", {}, 404),
}


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] is not None
    return error


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_rejected_and_server_survives(url, name):
    path, body, status = BAD_REQUESTS[name]
    if isinstance(body, bytes):
        response = httpx.post(f"{url}{path}", content=body,
                              headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{url}{path}", json=body)
    error = assert_openai_error(response, status)
    if name.startswith("prompt too long"):
        assert "is longer than the model's context length" in error["message"]
    if name == "unknown model":
        assert error["code"] == "model_not_found"
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, "max_tokens": 1}, timeout=10)
    assert ok.status_code == 200


def test_bad_request_via_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    assert "n=1" in info.value.message


def test_garbage_on_the_api_socket_is_survived(url, served):
    ctx = zmq.Context()
    push = sockets.push_socket(ctx, served[1].endpoints.api_input)
    push.send(b"not msgpack at all")
    sockets.send(push, AbortReq(rid="x"))  # a valid message of the wrong direction
    sockets.send(push, BatchStrOut(outputs=[ReqStrOut(  # a chunk for no known request
        rid="nobody", text="?", new_ids=[], finish=None, prompt_tokens=0, completion_tokens=0,
        cached_tokens=0)]))
    ctx.destroy(linger=1000)
    response = httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES}, timeout=10)
    assert response.json()["choices"][0]["message"]["content"] == FULL_TEXT


def test_engine_abort_is_a_500(url):
    body = {"messages": MESSAGES, "seed": ABORT_SEED}
    error = assert_openai_error(httpx.post(f"{url}{CHAT}", json=body, timeout=10), 500)
    assert "scheduler said no" in error["message"]
    with httpx.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}, timeout=10) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]" and "scheduler said no" in events[-2]["error"]["message"]


# ---- disconnects ---------------------------------------------------------------------------------


LONG = 2000  # tokens: 10 s of fake generation, far longer than any disconnect takes to notice


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_stream_disconnect_aborts_request(url, engine, served):
    tm = served[2]
    body = {"messages": MESSAGES, "stream": True, "max_tokens": LONG, "ignore_eos": True}
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=10) as response:
        lines = response.iter_lines()
        first = [next(lines) for _ in range(6)]
    rid = json.loads(first[0].removeprefix("data: "))["id"].removeprefix("chatcmpl-")
    assert wait_for(lambda: rid in engine.aborted_rids()), "no AbortReq after the disconnect"
    assert rid not in tm.rid_to_state


def test_non_stream_disconnect_aborts_request(url, engine, served):
    tm = served[2]
    before = set(engine.generate_reqs())
    body = {"input_ids": [4], "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=body, timeout=0.3)
    assert wait_for(lambda: len(set(engine.generate_reqs()) - before) == 1)
    rid = (set(engine.generate_reqs()) - before).pop()
    assert wait_for(lambda: rid in engine.aborted_rids()), "no AbortReq after the disconnect"
    assert rid not in tm.rid_to_state


def test_abort_request_route(url, engine, served):
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            body = {"rid": "my-rid", "input_ids": [4],
                    "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
            pending = asyncio.create_task(http.post("/generate", json=body))
            for _ in range(500):
                if "my-rid" in served[2].rid_to_state:
                    break
                await asyncio.sleep(0.01)
            assert (await http.post("/abort_request", json={"rid": "my-rid"})).status_code == 200
            return await pending

    assert_openai_error(asyncio.run(run()), 500)
    assert wait_for(lambda: "my-rid" in engine.aborted_rids())


# ---- api key and readiness -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tokenizer):
    server, engine, _ = start_server(tokenizer, api_key=API_KEY)
    yield server.url
    server.stop()
    engine.stop()


def test_api_key(keyed):
    assert_openai_error(httpx.get(f"{keyed}/v1/models"), 401)
    wrong = {"Authorization": "Bearer nope"}
    error = assert_openai_error(httpx.post(f"{keyed}{CHAT}", json={}, headers=wrong), 401)
    assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed}/health").status_code == 200
    assert httpx.get(f"{keyed}/health_generate", timeout=30).status_code == 200
    lower = {"Authorization": f"bearer {API_KEY}"}
    assert httpx.get(f"{keyed}/v1/models", headers=lower).status_code == 200
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key=API_KEY, max_retries=0)
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="bad", max_retries=0).models.list()
    assert httpx.get(f"{keyed}/server_info", headers={
        "Authorization": f"Bearer {API_KEY}"}).json()["api_key"] == "<redacted>"


def test_not_ready_is_503(tokenizer):
    server, engine, _ = start_server(tokenizer, send_ready=False)
    try:
        assert_openai_error(httpx.get(f"{server.url}/health"), 503)
        assert_openai_error(httpx.get(f"{server.url}/health_generate"), 503)
        response = httpx.post(f"{server.url}{CHAT}", json={"messages": MESSAGES})
        assert "not ready" in assert_openai_error(response, 503)["message"]
        assert httpx.get(f"{server.url}/v1/models").status_code == 200
    finally:
        server.stop()
        engine.stop()
