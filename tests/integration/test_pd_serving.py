"""Acceptance 1, 2, 3, 6 of issue 13 (prefill/decode disaggregation) and the default model's
part of issue 50's (prefill and decode with their own --tp): the default model served by a
prefill server and a decode server behind `shoal router`, against a colocated server with the
same flags: the same tokens, greedy and seeded, with tp 1 and tp 2 on both sides (and `ps`
showing each server's ranks), and greedy with tp 2 prefilling for tp 1 and tp 1 for tp 2; the
KV bytes accounted for; aborts at every stage and a decode killed mid-transfer leaving both
pools whole and the prefill serving, the restarted decode joining again through the router; the
bad inputs refused with clear errors.

The tp-1 pair is shared by the module; the tp-2 pair runs in the first test beside it (pairs of
one server of each are routers of their own, no more servers), and the test that kills the
tp-1 pair's decode runs last. A GQA model with fewer KV heads than ranks: test_pd_gqa.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from shoal.ports import free_port
from tests.support.generate import PROMPTS
from tests.support.pd import (
    PD_FLAGS,
    PDServers,
    RunningRouter,
    bytes_per_token,
    generate_all,
    kv_transfer_counters,
    start_pd,
    start_router,
    tiny_llama,
    wait_idle_and_whole,
)
from tests.support.reference import assert_same_or_tie
from tests.support.server import STARTUP_TIMEOUT_S, kill_tree, start_server, wait_healthy
from tests.support.wait import wait_until

# servers start inside tests (the first one: the colocated reference, the tp-1 pair, the tp-2
# pair): minutes each on a loaded 2-core machine
pytestmark = pytest.mark.timeout(1800)
NEW_TOKENS = 16
# the tp-2 pair answers every third prompt (three of them longer than a prefill chunk): its
# shards, not the prompt mix, are what it adds over the tp-1 pair
TP2_EVERY = 3
LONG_TOPICS = ["the history of the printing press", "how a steam engine works",
               "the water cycle", "the rules of chess", "how vaccines train the immune system",
               "the causes of the first world war"]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """32 prompts: short ones, and eight longer than the servers' 64-token prefill chunks."""
    texts = list(PROMPTS)
    texts += [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(14)]
    texts += [(f"Write a long essay about {topic}. " * (6 + i % 4)) + "Begin:\n"
              for i, topic in enumerate(LONG_TOPICS)]
    texts += ["Summarise: " + " ".join(PROMPTS) * 2, "Continue the list: " + ", ".join(
        str(n) for n in range(120))]
    ids = [tokenizer.encode(t) for t in texts]
    assert len(ids) == 32 and sum(len(p) > 64 for p in ids) >= 8
    return ids


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDServers]:
    servers = start_pd(tmp_path_factory.mktemp("pd"), *PD_FLAGS)
    yield servers
    servers.stop()


def seed_of(i: int) -> int:
    """The seed of prompt i in the seeded runs."""
    return 1000 + i


SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    "seeded": {"max_new_tokens": NEW_TOKENS, "temperature": 0.8, "top_p": 0.95,
               "ignore_eos": True, "seed": seed_of}}


@pytest.fixture(scope="module")
def reference(prompt_ids: list[list[int]],
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[int]]]:
    """What a colocated server with the same flags answers for the 32 prompts, `greedy` and
    `seeded` (the server stops then: the machine holds few servers at once)."""
    server = start_server(tmp_path_factory.mktemp("pd-colocated"), *PD_FLAGS, wait=False)
    try:
        wait_healthy(server, 2 * STARTUP_TIMEOUT_S)  # beside the rest of the suite's load
        return {kind: generate_all(server.base_url, prompt_ids, sampling)
                for kind, sampling in SAMPLING.items()}
    finally:
        server.stop()


def assert_greedy_equal(router_url: str, prompt_ids: list[list[int]],
                        reference: dict[str, list[list[int]]], model_path: str) -> None:
    got = generate_all(router_url, prompt_ids, SAMPLING["greedy"])
    for ids, want, out in zip(prompt_ids, reference["greedy"], got):
        assert len(out) == NEW_TOKENS
        assert_same_or_tie(model_path, ids, want, out)


def test_tp2_and_tp1_in_every_pairing_equal_a_colocated_server(
        prompt_ids: list[list[int]], reference: dict[str, list[list[int]]], pd: PDServers,
        tmp_path: Path, model_path: str) -> None:
    """tp 2 on both sides (greedy and seeded; `ps` shows each server's ranks), then a router of
    its own for prefill tp 2 -> decode tp 1 and prefill tp 1 -> decode tp 2 (SmolLM2's 3 KV
    heads: 2 + 1 over two ranks, gathered or split): greedy equal, and the KV bytes moved are
    the prompts' tokens x the model's KV size on both sides, whatever the split."""
    pair = start_pd(tmp_path, "--tp", "2", *PD_FLAGS)
    routers: list[RunningRouter] = []
    try:
        for server in (pair.prefill, pair.decode):  # `ps`: one scheduler per rank, per server
            assert {t for t in server.component_pids() if t.startswith("shoal::scheduler")} \
                == {"shoal::scheduler_TP0", "shoal::scheduler_TP1"}
        prompts = prompt_ids[::TP2_EVERY]
        picked = {kind: want[::TP2_EVERY] for kind, want in reference.items()}
        seeded = {**SAMPLING["seeded"], "seed": lambda i: seed_of(i * TP2_EVERY)}
        assert generate_all(pair.router.base_url, prompts, seeded) == picked["seeded"]
        sent = 'shoal:kv_transfer_bytes_total{direction="sent"}'
        received = 'shoal:kv_transfer_bytes_total{direction="received"}'
        expected = sum(len(p) for p in prompts) * bytes_per_token(model_path)
        pairings = [(pair.router, pair.prefill, pair.decode)]
        for prefill, decode in ((pair.prefill, pd.decode), (pd.prefill, pair.decode)):
            routers.append(start_router(tmp_path, "--prefill", prefill.base_url, "--decode",
                                        decode.base_url))
            pairings.append((routers[-1], prefill, decode))
        for router, prefill, decode in pairings:
            before_p = kv_transfer_counters(prefill.base_url).get(sent, 0)
            before_d = kv_transfer_counters(decode.base_url).get(received, 0)
            assert_greedy_equal(router.base_url, prompts, picked, model_path)
            wait_idle_and_whole(prefill.base_url, decode.base_url)
            assert kv_transfer_counters(prefill.base_url)[sent] - before_p == expected
            assert kv_transfer_counters(decode.base_url)[received] - before_d == expected
    finally:
        for router in routers:
            router.stop()
        pair.stop()


def test_greedy_outputs_equal_a_colocated_servers(
        prompt_ids: list[list[int]], reference: dict[str, list[list[int]]],
        pd: PDServers, model_path: str) -> None:
    assert_greedy_equal(pd.router.base_url, prompt_ids, reference, model_path)
    wait_idle_and_whole(pd.prefill.base_url, pd.decode.base_url)


def test_seeded_sampling_equals_a_colocated_servers(
        prompt_ids: list[list[int]], reference: dict[str, list[list[int]]],
        pd: PDServers) -> None:
    assert generate_all(pd.router.base_url, prompt_ids, SAMPLING["seeded"]) == \
        reference["seeded"]


def test_a_speculating_decode_server_gives_the_colocated_greedy_outputs(
        prompt_ids: list[list[int]], reference: dict[str, list[list[int]]], pd: PDServers,
        tmp_path: Path, model_path: str) -> None:
    """Issue 46: `--speculative-algorithm ngram` on a decode server (beside the module's, a
    router of its own to the module's prefill): it verifies proposals, greedy outputs equal the
    colocated server's, and both pools are whole afterwards."""
    decode = start_server(tmp_path, "--disaggregation-mode", "decode", *PD_FLAGS,
                          "--speculative-algorithm", "ngram", wait=False)
    router: RunningRouter | None = None
    try:
        wait_healthy(decode, 2 * STARTUP_TIMEOUT_S)
        router = start_router(tmp_path, "--prefill", pd.prefill.base_url, "--decode",
                              decode.base_url)
        picked = {kind: want[::2] for kind, want in reference.items()}
        assert_greedy_equal(router.base_url, prompt_ids[::2], picked, model_path)
        scheduler = httpx.get(f"{decode.base_url}/server_info", timeout=30).json()["scheduler"]
        assert scheduler["num_verify_steps"] > 0
        wait_idle_and_whole(pd.prefill.base_url, decode.base_url)
    finally:
        if router is not None:
            router.stop()
        decode.stop()


def test_kv_bytes_sent_equal_bytes_received_equal_prompt_tokens_times_kv_size(
        pd: PDServers, tokenizer: PreTrainedTokenizerBase, model_path: str) -> None:
    before_p, before_d = kv_transfer_counters(pd.prefill.base_url), kv_transfer_counters(
        pd.decode.base_url)
    prompts = [tokenizer.encode(f"Tell me fact number {i} about octopuses.") for i in range(4)]
    generate_all(pd.router.base_url, prompts, {"max_new_tokens": 2, "temperature": 0})
    after_p, after_d = kv_transfer_counters(pd.prefill.base_url), kv_transfer_counters(
        pd.decode.base_url)
    sent = 'shoal:kv_transfer_bytes_total{direction="sent"}'
    received = 'shoal:kv_transfer_bytes_total{direction="received"}'
    tokens = sum(len(p) for p in prompts)
    expected = tokens * bytes_per_token(model_path)  # 46,080 bytes per token for SmolLM2-135M
    assert after_p[sent] - before_p.get(sent, 0) == expected
    assert after_d[received] - before_d.get(received, 0) == expected


async def _disconnect_after(url: str, body: dict[str, Any], seconds: float,
                            chunks: int = 0) -> None:
    """Send a streamed request and walk away: after `seconds`, or after `chunks` chunks."""
    async with httpx.AsyncClient(timeout=60) as client:
        async def read() -> None:
            async with client.stream("POST", url, json={**body, "stream": True}) as response:
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data:")
                    if chunks and seen >= chunks:
                        return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(read(), seconds)


def test_aborts_at_every_stage_leave_both_pools_whole(pd: PDServers,
                                                      tokenizer: PreTrainedTokenizerBase) -> None:
    long_ids = tokenizer.encode("Describe a walk through the old town. " * 90)  # ~800 tokens
    stranger = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port}
    sampling = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def run() -> None:
        await asyncio.gather(
            # the prefill waits for a decode that never comes; the decode waits for KV that
            # never comes: each client leaves while its request waits
            _disconnect_after(pd.prefill.base_url + "/generate",
                              {"text": "alone", "sampling_params": sampling,
                               "bootstrap_room": 11, **stranger}, 2.0),
            _disconnect_after(pd.decode.base_url + "/generate",
                              {"text": "alone too", "sampling_params": sampling,
                               "bootstrap_room": 12, **stranger}, 2.0),
            # through the router: during the long prompt's transfer, and while decoding
            _disconnect_after(pd.router.base_url + "/generate",
                              {"input_ids": long_ids, "sampling_params": sampling}, 1.5),
            _disconnect_after(pd.router.base_url + "/generate",
                              {"text": "Count slowly:", "sampling_params": sampling}, 60,
                              chunks=4),
            *(_disconnect_after(pd.router.base_url + "/generate",
                                {"input_ids": long_ids[:300 + 50 * i],
                                 "sampling_params": sampling}, 0.5 + 0.7 * i)
              for i in range(4)))
    asyncio.run(run())
    wait_idle_and_whole(pd.prefill.base_url, pd.decode.base_url)
    r = httpx.post(pd.router.base_url + "/generate", timeout=120, json={
        "text": "Still serving?", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    wait_idle_and_whole(pd.prefill.base_url, pd.decode.base_url)


def test_a_pd_server_without_the_router_says_how_to_reach_it(pd: PDServers) -> None:
    for server, mode in ((pd.prefill, "prefill"), (pd.decode, "decode")):
        r = httpx.post(server.base_url + "/generate", timeout=30, json={"text": "hi"})
        assert r.status_code == 400
        assert f"This is a {mode} server" in r.json()["error"]["message"]
        assert "shoal router" in r.json()["error"]["message"]
        assert httpx.get(server.base_url + "/health_generate", timeout=60).status_code == 200


def test_structured_outputs_are_refused_with_a_400_that_says_so(pd: PDServers) -> None:
    """Constrained decoding runs only in a colocated scheduler: the pair refuses it up front."""
    requests = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "JSON?"}],
                                          "response_format": {"type": "json_object"}}),
                ("/v1/completions", {"prompt": "A number:", "max_tokens": 4,
                                     "response_format": {"type": "json_object"}}),
                ("/generate", {"text": "A number:", "sampling_params": {"regex": "[0-9]+"}})]
    for path, body in requests:
        r = httpx.post(pd.router.base_url + path, timeout=60, json=body)
        assert r.status_code == 400, (path, r.text)
        assert "not served with prefill/decode disaggregation" in r.json()["error"]["message"]
    wait_idle_and_whole(pd.prefill.base_url, pd.decode.base_url)


def test_the_responses_api_through_the_router_equals_chat_completions(pd: PDServers) -> None:
    question = "Name three colours of the sea."
    chat = httpx.post(pd.router.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": question}], "max_tokens": NEW_TOKENS,
        "temperature": 0})
    assert chat.status_code == 200, chat.text
    response = httpx.post(pd.router.base_url + "/v1/responses", timeout=120, json={
        "input": question, "max_output_tokens": NEW_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] in ("completed", "incomplete")
    text = "".join(part["text"] for item in body["output"] for part in item["content"])
    assert text == chat.json()["choices"][0]["message"]["content"]
    assert body["usage"]["output_tokens"] == chat.json()["usage"]["completion_tokens"]
    wait_idle_and_whole(pd.prefill.base_url, pd.decode.base_url)


def test_an_unreachable_bootstrap_server_fails_the_request_with_a_5xx(pd: PDServers) -> None:
    started = time.monotonic()
    r = httpx.post(pd.decode.base_url + "/generate", timeout=120, json={
        "text": "hello", "sampling_params": {"max_new_tokens": 4},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 7})
    assert time.monotonic() - started < 30 + 10
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "bootstrap server at 127.0.0.1:" in message and "did not answer within 30 s" in message


def test_a_prefill_serving_another_model_is_refused_at_the_handshake(
        pd: PDServers, model_path: str, tmp_path: Path) -> None:
    tiny_llama(tmp_path / "tiny", model_path)
    bootstrap = free_port()
    tiny = start_server(tmp_path, "--model-path", str(tmp_path / "tiny"), "--served-model-name",
                        "tiny-llama", "--disaggregation-mode", "prefill",
                        "--disaggregation-bootstrap-port", str(bootstrap),
                        "--max-total-tokens", "1024")
    try:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 4},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                "bootstrap_room": 99}

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return list(await asyncio.gather(
                    client.post(tiny.base_url + "/generate", json=body),
                    client.post(pd.decode.base_url + "/generate", json=body)))
        for response in asyncio.run(both()):
            assert response.status_code == 500
            message = response.json()["error"]["message"]
            assert "'tiny-llama'" in message and "'SmolLM2-135M-Instruct'" in message
    finally:
        tiny.stop()
    wait_idle_and_whole(pd.decode.base_url)


def test_a_decode_killed_mid_transfer_leaves_the_prefill_serving_and_rejoins(
        pd: PDServers, tokenizer: PreTrainedTokenizerBase, tmp_path: Path,
        model_path: str) -> None:
    """Last in the module: the pair's decode server is replaced."""
    long_ids = tokenizer.encode("Describe a harbour at dawn. " * 250)  # ~1,500 tokens, new
    sent = 'shoal:kv_transfer_bytes_total{direction="sent"}'
    before = kv_transfer_counters(pd.prefill.base_url).get(sent, 0)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, pd.router.base_url + "/generate", timeout=120, json={
            "input_ids": long_ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        wait_until(lambda: kv_transfer_counters(pd.prefill.base_url).get(sent, 0) > before,
                   60, "the prefill sends the long prompt's first chunks", interval=0.05)
        kill_tree(pd.decode.proc.pid)
        pd.decode.proc.wait()
        response = answer.result()
    assert response.status_code >= 500, response.text
    sent_now = kv_transfer_counters(pd.prefill.base_url)[sent]
    assert sent_now - before < len(long_ids) * bytes_per_token(model_path)  # not all of it

    wait_idle_and_whole(pd.prefill.base_url)  # the decode's heartbeat is lost: slots freed
    assert httpx.get(pd.prefill.base_url + "/health_generate", timeout=60).status_code == 200
    wait_until(lambda: httpx.get(pd.router.base_url + "/health", timeout=5).status_code == 503,
               30, "the router takes the dead decode server out")

    port = int(pd.decode.base_url.rsplit(":", 1)[1])
    pd.decode = start_server(tmp_path, "--disaggregation-mode", "decode", *PD_FLAGS, port=port)
    wait_until(lambda: httpx.get(pd.router.base_url + "/health", timeout=5).status_code == 200,
               30, "the router puts the restarted decode server back")
    r = httpx.post(pd.router.base_url + "/generate", timeout=120, json={
        "input_ids": long_ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    wait_idle_and_whole(pd.prefill.base_url, pd.decode.base_url)
