"""The api process end to end over real HTTP: uvicorn + TokenizerManager + a fake engine.

Driven with the official `openai` client and httpx; the fake engine (tests/support/fake_engine.py)
plays the scheduler and detokenizer over the real ZMQ sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import openai
import pytest
import zmq

from shoal.api.process import with_context_length
from shoal.config import ServerArgs
from shoal.ipc import sockets
from shoal.ipc.messages import AbortReq, BatchStrOut, ReqStrOut
from shoal.lifecycle import StartupFailed
from tests.support.fake_api import CONTEXT, MODEL, fake_api, start_fake_api
from tests.support.fake_engine import (
    ABORT_SEED,
    EOS_ID,
    REFUSE_SEED,
    WORD_IDS,
    WORDS,
    fake_logprob,
)
from tests.support.wait import wait_until

API_KEY = "sk-test-123"
FULL_TEXT = "".join(WORDS)
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def served(tokenizer):
    with fake_api(tokenizer) as api:
        yield api.server, api.engine, api.tm


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


# ---- n choices and logprobs ----------------------------------------------------------------------


def test_chat_n_choices(client, engine, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, seed=11,
                                          temperature=0.7)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.message.content == FULL_TEXT for c in resp.choices)
    assert resp.usage.prompt_tokens == prompt_len(tokenizer)  # the prompt counts once
    assert resp.usage.completion_tokens == 3 * (len(WORDS) + 1)
    rid = resp.id.removeprefix("chatcmpl-")
    reqs = engine.generate_reqs()
    assert [reqs[f"{rid}-{i}"].sampling.seed for i in range(3)] == [11, 12, 13]
    assert f"{rid}-prefix" not in reqs  # a short prompt is not warmed up


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_n_choices_stream(client, tokenizer, route):
    if route == "chat":
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=3,
                                                stream=True,
                                                stream_options={"include_usage": True})
    else:
        stream = client.completions.create(model=MODEL, prompt="Hi", n=2, max_tokens=3,
                                           stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 6
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += (choice.delta.content or "") if route == "chat" else choice.text
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == {0: "".join(WORDS[:3]), 1: "".join(WORDS[:3])}
    assert finishes == {0: ["length"], 1: ["length"]}
    if route == "chat":
        roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
        assert sorted(roles) == [0, 1]


def test_n_choices_warm_up_a_long_prompt(client, engine):
    prompt = list(range(200, 300))
    resp = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=2)
    assert len(resp.choices) == 2 and resp.usage.prompt_tokens == 100
    warm = engine.generate_reqs()[resp.id.removeprefix("cmpl-") + "-prefix"]
    assert warm.input_ids == prompt and warm.sampling.max_new_tokens == 1


# ---- batched prompts -----------------------------------------------------------------------------

BATCH = ["Once upon a time", "The sky is", "Hi"]


@pytest.mark.parametrize("as_ids", [False, True])
def test_completion_batch(client, engine, tokenizer, as_ids):
    ids = [tokenizer.encode(p) for p in BATCH]
    resp = client.completions.create(model=MODEL, prompt=ids if as_ids else BATCH, n=2, seed=5,
                                     temperature=0.5, max_tokens=3)
    assert [c.index for c in resp.choices] == list(range(6))
    assert all(c.text == "".join(WORDS[:3]) for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)
    assert resp.usage.completion_tokens == 6 * 3
    assert resp.usage.prompt_tokens_details.cached_tokens == sum(len(i) // 2 for i in ids)
    rid, reqs = resp.id.removeprefix("cmpl-"), engine.generate_reqs()
    sent = [reqs[f"{rid}-{i}"] for i in range(6)]
    assert [r.input_ids for r in sent] == [ids[i // 2] for i in range(6)]
    assert [r.sampling.seed for r in sent] == [5, 6] * 3


def test_completion_batch_echo_and_logprobs(client, tokenizer):
    resp = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=2, echo=True,
                                     logprobs=0)
    for prompt, choice in zip(BATCH, resp.choices):
        assert choice.text == prompt + "".join(WORDS[:2])
        assert choice.logprobs.tokens == token_texts(tokenizer, tokenizer.encode(prompt)
                                                     + WORD_IDS[:2])
        first_word = token_texts(tokenizer, WORD_IDS[:1])[0]
        assert choice.logprobs.text_offset[-1] == len(prompt) + len(first_word)


def test_completion_batch_stream(client, tokenizer):
    chunks = list(client.completions.create(model=MODEL, prompt=BATCH, n=2, max_tokens=3,
                                            stream=True, echo=True,
                                            stream_options={"include_usage": True}))
    texts, finishes = {i: "" for i in range(6)}, {i: [] for i in range(6)}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == {i: BATCH[i // 2] + "".join(WORDS[:3]) for i in range(6)}
    assert finishes == {i: ["length"] for i in range(6)}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 18
    assert usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in BATCH)


def test_batch_stream_disconnect_aborts_every_prompt(url, engine):
    body = {"prompt": BATCH, "n": 2, "stream": True, "max_tokens": LONG, "ignore_eos": True}
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=10) as response:
        first = json.loads(next(response.iter_lines()).removeprefix("data: "))
    rid = first["id"].removeprefix("cmpl-")
    rids = {f"{rid}-{i}" for i in range(6)}
    wait_until(lambda: rids <= engine.aborted_rids(), timeout=5,
               what="an AbortReq for every choice of the batch", interval=0.02)


def token_texts(tokenizer, ids):
    """Logprobs name each token by its text decoded alone (the fake engine's ids are real ids)."""
    return [tokenizer.decode([i]) for i in ids]


def test_chat_logprobs(client, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    texts = token_texts(tokenizer, WORD_IDS[:3])
    assert [t.token for t in content] == texts
    assert [t.logprob for t in content] == [fake_logprob(k) for k in range(3)]
    assert content[0].bytes == list(texts[0].encode())
    assert [len(t.top_logprobs) for t in content] == [2, 2, 2]
    assert content[1].top_logprobs[1].token == texts[1]  # id 101
    assert content[1].top_logprobs[1].logprob == fake_logprob(1)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_stream(client, tokenizer):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                 logprobs=True, stream=True))
    scored = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert [t.token for t in scored] == token_texts(tokenizer, WORD_IDS[:3])
    assert all(t.top_logprobs == [] for t in scored)


def test_completion_logprobs_with_echo(client, tokenizer):
    ids = tokenizer.encode("The sky is")
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True, logprobs=1)
    lp = resp.choices[0].logprobs
    echo = tokenizer.decode(ids)
    assert resp.choices[0].text == echo + "".join(WORDS[:2])
    words = token_texts(tokenizer, WORD_IDS[:2])
    assert lp.tokens == token_texts(tokenizer, ids) + words
    assert lp.token_logprobs == [None] + [-i / 10 for i in range(1, len(ids))] + [
        fake_logprob(0), fake_logprob(1)]
    # each entry: the top alternative, and the token itself (as OpenAI's and vLLM's do)
    assert lp.top_logprobs[0] is None and lp.top_logprobs[-1] == {words[0]: fake_logprob(0),
                                                                  words[1]: fake_logprob(1)}
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len(echo)
    assert lp.text_offset[-1] == len(echo) + len(words[0])


def test_completion_logprobs_zero_holds_each_sampled_token(client, tokenizer):
    words = token_texts(tokenizer, WORD_IDS[:3])
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=0)
    lp = resp.choices[0].logprobs
    assert lp.top_logprobs == [{w: fake_logprob(k)} for k, w in enumerate(words)]
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=0,
                                            stream=True))
    streamed = [top for c in chunks if c.choices[0].logprobs
                for top in c.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs


def test_chat_top_logprobs_zero_scores_each_token_alone(client, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          logprobs=True, top_logprobs=0)
    content = resp.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in content] == [
        (w, fake_logprob(k)) for k, w in enumerate(token_texts(tokenizer, WORD_IDS[:3]))]
    assert all(t.top_logprobs == [] for t in content)


def test_completion_logprobs_stream_with_echo(client, tokenizer):
    chunks = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2,
                                            echo=True, logprobs=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == "The sky is" and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == len(tokenizer.encode("The sky is"))
    later = [c.choices[0].logprobs for c in chunks[1:] if c.choices[0].logprobs]
    assert [t for lp in later for t in lp.tokens] == token_texts(tokenizer, WORD_IDS[:2])
    assert later[0].text_offset == [len("The sky is")]


def test_generate_native_logprobs(url, tokenizer):
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 1,
            "logprob_start_len": 0, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 2}}
    meta = httpx.post(f"{url}/generate", json=body, timeout=10).json()["meta_info"]
    words = token_texts(tokenizer, WORD_IDS[:2])
    assert meta["output_token_logprobs"] == [[fake_logprob(0), WORD_IDS[0], words[0]],
                                             [fake_logprob(1), WORD_IDS[1], words[1]]]
    assert meta["output_top_logprobs"][1] == [[fake_logprob(0), 100, words[0]]]
    assert [e[:2] for e in meta["input_token_logprobs"]] == [[None, 5], [-0.1, 6], [-0.2, 7]]
    assert meta["input_top_logprobs"][0] == []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True},
                      timeout=10) as response:
        events = sse_events(response)
    assert events[-2]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
    plain = httpx.post(f"{url}/generate", json={"input_ids": [5]}, timeout=10).json()
    assert "output_token_logprobs" not in plain["meta_info"]


def test_penalties_reach_the_engine(client, engine):
    resp = client.completions.create(
        model=MODEL, prompt="x", max_tokens=4, frequency_penalty=0.5, presence_penalty=-0.5,
        logit_bias={"17": -100}, extra_body={"repetition_penalty": 1.2, "min_tokens": 2})
    sampling = engine.generate_reqs()[resp.id.removeprefix("cmpl-")].sampling
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (0.5, -0.5)
    assert sampling.repetition_penalty == 1.2 and sampling.min_new_tokens == 2
    assert sampling.logit_bias == {17: -100.0}


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
    "n=9": (CHAT, {"messages": MESSAGES, "n": 9}, 400),
    "n=0": (COMPLETIONS, {"prompt": "x", "n": 0}, 400),
    "top_logprobs 21": (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400),
    "top_logprobs without logprobs": (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400),
    "completion logprobs 21": (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400),
    "presence_penalty 3": (CHAT, {"messages": MESSAGES, "presence_penalty": 3}, 400),
    "frequency_penalty -3": (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, 400),
    "repetition_penalty 0": (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, 400),
    "logit_bias out of vocabulary": (CHAT, {"messages": MESSAGES,
                                            "logit_bias": {str(10**7): 1}}, 400),
    "logit_bias value 200": (CHAT, {"messages": MESSAGES, "logit_bias": {"5": 200}}, 400),
    "logit_bias key not an id": (COMPLETIONS, {"prompt": "x", "logit_bias": {"a": 1}}, 400),
    "min_tokens above max_tokens": (COMPLETIONS, {"prompt": "x", "max_tokens": 2,
                                                  "min_tokens": 3}, 400),
    "generate logit_bias out of vocabulary": ("/generate", {"text": "a", "sampling_params": {
        "logit_bias": {str(10**7): 1}}}, 400),
    "generate top_logprobs_num 21": ("/generate", {"text": "a", "return_logprob": True,
                                                   "top_logprobs_num": 21}, 400),
    "unknown model": (CHAT, {"messages": MESSAGES, "model": "gpt-4o"}, 404),
    "missing prompt": (COMPLETIONS, {"max_tokens": 3}, 400),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400),
    "empty prompt in a batch": (COMPLETIONS, {"prompt": ["a", ""]}, 400),
    "too many prompts": (COMPLETIONS, {"prompt": ["a"] * 257}, 400),
    "stream_options without stream": (CHAT, {"messages": MESSAGES,
                                             "stream_options": {"include_usage": True}}, 400),
    "unknown field": (CHAT, {"messages": MESSAGES, "frobnicate": 1}, 400),
    "refused extension": (COMPLETIONS, {"prompt": "x", "guided_json": {"type": "object"}}, 400),
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
    "generate refused sampling field": ("/generate", {"text": "a",
                                                      "sampling_params": {"n": 2}}, 400),
    "responses without input": ("/v1/responses", {"model": MODEL}, 400),
    "responses previous_response_id": ("/v1/responses", {"input": "hi",
                                                         "previous_response_id": "resp_1"}, 400),
    "responses image input": ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, 400),
    "responses unknown model": ("/v1/responses", {"input": "hi", "model": "gpt-4o"}, 404),
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
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=9)
    assert "n" in info.value.body["param"] and "8" in info.value.message


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


@pytest.mark.parametrize("seed, status, message", [
    (ABORT_SEED, 500, "scheduler said no"),  # an abort of the engine's own
    (REFUSE_SEED, 400, "the regex is odd"),  # the engine refused the request as given
])
def test_an_engine_abort_is_an_error_of_its_kind(url, seed, status, message):
    body = {"messages": MESSAGES, "seed": seed}
    error = assert_openai_error(httpx.post(f"{url}{CHAT}", json=body, timeout=10), status)
    assert message in error["message"]
    with httpx.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}, timeout=10) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]" and message in events[-2]["error"]["message"]


def test_chat_template_options_shape_the_prompt(client, engine, tokenizer):
    continued = [*MESSAGES, {"role": "assistant", "content": "Hello there, my"}]
    cases = [({"continue_final_message": True}, continued,
              {"continue_final_message": True, "add_generation_prompt": False}),
             ({"add_generation_prompt": False}, MESSAGES, {"add_generation_prompt": False}),
             ({}, MESSAGES, {"add_generation_prompt": True})]
    for extra, messages, template in cases:
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                              extra_body=extra)
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
        sent = engine.generate_reqs()[resp.id.removeprefix("chatcmpl-")].input_ids
        assert sent == tokenizer.encode(text, add_special_tokens=False), extra
    assert tokenizer.decode(engine.generate_reqs()[resp.id.removeprefix("chatcmpl-")]
                            .input_ids).endswith("assistant\n")
    continued_text = tokenizer.apply_chat_template(continued, tokenize=False,
                                                   continue_final_message=True)
    assert continued_text.endswith("Hello there, my")


def test_chat_template_option_errors_name_their_field(url):
    for body, param in (({"continue_final_message": True}, None),
                        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                        ({"temperature": 2.5}, "temperature")):
        error = assert_openai_error(httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, **body},
                                               timeout=10), 400)
        assert error["param"] == param, error


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_count_each_chunk(client, route):
    kwargs = {"model": MODEL, "max_tokens": 4, "stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = list(client.chat.completions.create(messages=MESSAGES, **kwargs) if route == "chat"
                  else client.completions.create(prompt="Hi", **kwargs))
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counted == [1, 2, 3, 4]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert {c.usage.prompt_tokens for c in chunks if c.usage} == {chunks[-1].usage.prompt_tokens}


# ---- disconnects ---------------------------------------------------------------------------------


LONG = 2000  # tokens: 10 s of fake generation, far longer than any disconnect takes to notice


def test_stream_disconnect_aborts_request(url, engine, served, caplog):
    """The request is aborted, and the log says why (the disconnect seen by polling, or the
    stream closed under it)."""
    caplog.set_level(logging.INFO, logger="shoal.api.tokenizer_manager")
    tm = served[2]
    body = {"messages": MESSAGES, "stream": True, "max_tokens": LONG, "ignore_eos": True}
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=10) as response:
        lines = response.iter_lines()
        first = [next(lines) for _ in range(6)]
    rid = json.loads(first[0].removeprefix("data: "))["id"].removeprefix("chatcmpl-")
    wait_until(lambda: rid in engine.aborted_rids(), timeout=5,
               what="an AbortReq after the disconnect", interval=0.02)
    assert rid not in tm.rid_to_state
    said = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert any("client disconnected" in m or "closed before its last chunk" in m
               for m in said), said


def test_non_stream_disconnect_aborts_request(url, engine, served):
    tm = served[2]
    before = set(engine.generate_reqs())
    body = {"input_ids": [4], "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=body, timeout=0.3)
    wait_until(lambda: len(set(engine.generate_reqs()) - before) == 1, timeout=5,
               what="the request reaches the engine", interval=0.02)
    rid = (set(engine.generate_reqs()) - before).pop()
    wait_until(lambda: rid in engine.aborted_rids(), timeout=5,
               what="an AbortReq after the disconnect", interval=0.02)
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
    wait_until(lambda: "my-rid" in engine.aborted_rids(), timeout=5,
               what="an AbortReq for my-rid", interval=0.02)


# ---- api key and readiness -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tokenizer):
    api = start_fake_api(tokenizer, api_key=API_KEY)
    yield api.url
    api.stop()


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
    api = start_fake_api(tokenizer, send_ready=False, context_length=1000)
    try:
        assert_openai_error(httpx.get(f"{api.url}/health"), 503)
        assert_openai_error(httpx.get(f"{api.url}/health_generate"), 503)
        response = httpx.post(f"{api.url}{CHAT}", json={"messages": MESSAGES})
        assert "not ready" in assert_openai_error(response, 503)["message"]
        models = httpx.get(f"{api.url}/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 1000
    finally:
        api.stop()


def test_api_resolves_the_context_length_before_the_scheduler(model_path):
    config = json.loads((Path(model_path) / "config.json").read_text())
    assert with_context_length(ServerArgs(), model_path).context_length == \
        config["max_position_embeddings"]
    assert with_context_length(ServerArgs(context_length=512), model_path).context_length == 512
    with pytest.raises(StartupFailed):
        with_context_length(ServerArgs(), "/nonexistent-model")
