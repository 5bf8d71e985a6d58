"""Acceptance (speculative decoding): a server with `--speculative-algorithm NGRAM` gives the same
greedy output with speculation as a request that opts out, on text that repeats its input (where
proposals are accepted) and on random words, with a JSON schema too, and its KV pool is whole
afterwards."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import RunningServer, start_server
from tests.support.wait import wait_until

WORDS = ["lantern", "harbor", "meadow", "copper", "violin", "glacier", "orchard", "pepper",
         "canyon", "ribbon", "thunder", "marble", "saddle", "quartz", "willow", "falcon"]
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed "
           "the wick, polished the great lens, and wrote the weather in a leather logbook. Ships "
           "passed far out on the grey water, and none of them knew his name.")
REPEAT = f"Copy this text exactly.\n\nText: {PASSAGE}\n\nCopy: {PASSAGE[:60]}"
RECORD = {"name": "Ada Lovelace", "city": "London", "tags": ["mathematics", "engines", "notes"]}
RECORD_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "city", "tags"], "additionalProperties": False}
COPY_JSON = (f"Copy this JSON exactly.\n\nJSON: {json.dumps(RECORD, separators=(',', ':'))}"
             f"\n\nCopy: ")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(Path(tmp_path_factory.mktemp("spec-server")), "--max-total-tokens",
                          "8192", "--speculative-algorithm", "NGRAM",
                          "--speculative-num-draft-tokens", "6")
    yield server
    server.stop()


def generate(client: httpx.Client, text: str, max_new: int, **extra: object) -> list[int]:
    r = client.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **extra}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def scheduler_info(client: httpx.Client) -> dict:
    return client.get("/server_info").json()["scheduler"]


def test_greedy_output_is_the_same_with_and_without_speculation(
        spec_server: RunningServer) -> None:
    rng = random.Random(3)
    random_words = " ".join(rng.choice(WORDS) for _ in range(80))
    with httpx.Client(base_url=spec_server.base_url, timeout=300) as client:
        for text in (REPEAT, random_words):
            before = scheduler_info(client)
            plain = generate(client, text, 48, speculative=False)
            assert scheduler_info(client)["num_verify_steps"] == before["num_verify_steps"]
            assert generate(client, text, 48) == plain
            after = scheduler_info(client)
            steps = after["num_verify_steps"] - before["num_verify_steps"]
            tokens = after["num_verified_tokens"] - before["num_verified_tokens"]
            assert steps > 0
            if text is REPEAT:  # copying: most proposals are accepted
                assert tokens / steps > 2.5, (tokens, steps)
        # structured outputs speculate: a JSON record copied from the prompt, the same with
        # and without, valid, and mostly from accepted proposals
        before = scheduler_info(client)
        answers = [client.post("/generate", json={"text": COPY_JSON, "sampling_params": {
            "max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(RECORD_SCHEMA),
            "speculative": speculative}}).json() for speculative in (False, True)]
        assert answers[0]["output_ids"] == answers[1]["output_ids"]
        assert answers[1]["meta_info"]["finish_reason"]["type"] == "stop", answers[1]
        assert set(json.loads(answers[1]["text"])) == {"name", "city", "tags"}
        after = scheduler_info(client)
        steps = after["num_verify_steps"] - before["num_verify_steps"]
        assert steps > 0
        assert (after["num_verified_tokens"] - before["num_verified_tokens"]) / steps > 2
        # sampled requests speculate too, seeded ones reproducibly
        sampled = [generate(client, REPEAT, 32, temperature=0.8, seed=5) for _ in range(2)]
        assert sampled[0] == sampled[1] and len(sampled[0]) == 32
        wait_until(lambda: scheduler_info(client)["num_running_reqs"] == 0, 30,
                   "the server is idle")
        info = scheduler_info(client)
    assert info["num_free_slots"] + info["num_cached_slots"] == info["num_total_slots"]
    assert "KV pool leak" not in spec_server.log()
