"""Issue 50's acceptance for a GQA model with fewer KV heads than the larger side's ranks: a
random-weight Llama with 4 query heads sharing 1 KV head, served by a prefill and a decode
server with their own --tp, behind `shoal router`, against a colocated server of it.

With tp 2 each rank holds a copy of the one KV head: prefill tp 2 -> decode tp 1 takes it from
prefill rank 0 only, prefill tp 1 -> decode tp 2 sends a copy to each decode rank, tp 2 -> tp 2
rank r to rank r; prefill pp 2 -> decode tp 2 gathers each decode rank's layers from both
stages. Six servers of the tiny model start side by side, then one router per pairing
(docs/pd.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from shoal.ports import free_port
from tests.support.pd import (
    PD_FLAGS,
    RunningRouter,
    bytes_per_token,
    generate_all,
    kv_transfer_counters,
    start_router,
    tiny_llama,
    wait_idle_and_whole,
)
from tests.support.reference import assert_same_or_tie
from tests.support.server import STARTUP_TIMEOUT_S, RunningServer, start_server, wait_healthy

pytestmark = pytest.mark.timeout(900)
NEW_TOKENS = 16
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
SPLITS = {"tp1": ("--tp", "1"), "tp2": ("--tp", "2"), "pp2": ("--pp", "2")}
SENT = 'shoal:kv_transfer_bytes_total{direction="sent"}'
RECEIVED = 'shoal:kv_transfer_bytes_total{direction="received"}'


@dataclass
class TinyServers:
    path: Path
    colocated: RunningServer
    prefill: dict[str, RunningServer]  # by split: "tp1", "tp2", "pp2"
    decode: dict[str, RunningServer]    # "tp1", "tp2"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[TinyServers]:
    tmp = tmp_path_factory.mktemp("pd-gqa")
    path = tmp / "tiny-gqa"
    tiny_llama(path, model_path, num_kv_heads=1)
    model = ("--model-path", str(path))
    started: list[RunningServer] = []

    def start(*flags: str) -> RunningServer:
        started.append(start_server(tmp, *model, *PD_FLAGS, *flags, wait=False))
        return started[-1]
    try:
        servers = TinyServers(
            path, start(),
            {split: start(*SPLITS[split], "--disaggregation-mode", "prefill",
                          "--disaggregation-bootstrap-port", str(free_port()))
             for split in ("tp1", "tp2", "pp2")},
            {split: start(*SPLITS[split], "--disaggregation-mode", "decode")
             for split in ("tp1", "tp2")})
        for server in started:
            wait_healthy(server, 3 * STARTUP_TIMEOUT_S)  # six servers load side by side
        yield servers
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Short prompts and two longer than the servers' 64-token prefill chunks."""
    texts = ["The capital of France is", "List three colours:", "1, 2, 3, 4,",
             "Once upon a time", "Write a haiku about the sea.", "def add(a, b):",
             "Describe a busy market. " * 20, "Count: " + " ".join(str(n) for n in range(60))]
    ids = [tokenizer.encode(t) for t in texts]
    assert sum(len(p) > 64 for p in ids) >= 2
    return ids


@pytest.fixture(scope="module")
def reference(tiny: TinyServers, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The colocated server's greedy outputs."""
    return generate_all(tiny.colocated.base_url, prompt_ids, GREEDY)


@pytest.mark.parametrize(("prefill_split", "decode_split"),
                         [("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "tp2"), ("pp2", "tp2")])
def test_one_kv_head_over_two_ranks_on_either_side_equals_a_colocated_server(
        tiny: TinyServers, prompt_ids: list[list[int]], reference: list[list[int]],
        tmp_path: Path, prefill_split: str, decode_split: str) -> None:
    prefill, decode = tiny.prefill[prefill_split], tiny.decode[decode_split]
    router: RunningRouter = start_router(tmp_path, "--prefill", prefill.base_url, "--decode",
                                         decode.base_url)
    try:
        before_p = kv_transfer_counters(prefill.base_url).get(SENT, 0)
        before_d = kv_transfer_counters(decode.base_url).get(RECEIVED, 0)
        got = generate_all(router.base_url, prompt_ids, GREEDY)
        for ids, expected, out in zip(prompt_ids, reference, got):
            assert len(out) == NEW_TOKENS
            assert_same_or_tie(str(tiny.path), ids, expected, out)
        wait_idle_and_whole(prefill.base_url, decode.base_url)
        # the one KV head moves once per decode rank (each holds a copy), from one prefill rank
        expected_bytes = sum(len(p) for p in prompt_ids) * bytes_per_token(str(tiny.path)) \
            * int(SPLITS[decode_split][1])
        assert kv_transfer_counters(prefill.base_url)[SENT] - before_p == expected_bytes
        assert kv_transfer_counters(decode.base_url)[RECEIVED] - before_d == expected_bytes
    finally:
        router.stop()
