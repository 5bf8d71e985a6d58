"""Incremental detokenization with the real SmolLM2 tokenizer, and the detokenizer process."""

from __future__ import annotations

import multiprocessing
import random
from pathlib import Path

import pytest
import zmq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from shoal.config import ComponentArgs, ServerArgs
from shoal.detokenizer.incremental import REPLACEMENT_CHAR, IncrementalDetokenizer
from shoal.detokenizer.process import run_detokenizer
from shoal.ipc.messages import (
    BatchStrOut,
    BatchTokenOut,
    ComponentReady,
    FinishReason,
    ReqTokenOut,
)
from shoal.ipc.sockets import Endpoints, pull_socket, push_socket, recv, send

TEXTS = [
    "Hello, world! Ça va? Les élèves étaient très enthousiastes, naïve façade, straße.",
    "Emoji 😀🎉 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 and skin tones 👍🏽 done.",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Numbers: 3.14159, 1,000,000 and 2024-06-01T12:34:56Z; 0x1F600 = 128512, -7e-3.",
    "def f(x):\n    return x  *  2\n\n\tif x:\n\t\tpass   \n\n\n    # trailing   ",
    "Combining e\u0301 and math ∑∏√∫≈ with arrows →⇒ and box ┌─┐.",
]
LENGTH = FinishReason(kind="length")


def out(rid: str, new_ids: list[int], finish: FinishReason | None = None,
        **first_only: object) -> ReqTokenOut:
    return ReqTokenOut(rid=rid, new_ids=new_ids, finish=finish, prompt_tokens=0,
                       completion_tokens=0, cached_tokens=0, **first_only)


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, start = [], 0
    for size in sizes:
        chunks.append(ids[start:start + size])
        start += size
    return chunks


def feed(detok: IncrementalDetokenizer, chunks: list[list[int]],
         finish: FinishReason = LENGTH, **first_only: object) -> list[str]:
    """Send `chunks` as one request's outputs, the last one finishing; return the texts."""
    texts = []
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        extra = first_only if i == 0 else {}
        texts += detok.detokenize([out("r", ids, finish if last else None, **extra)])
    assert "r" not in detok.states
    return texts


def stopped_at(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: str) -> list[int]:
    """The ids a scheduler generates before it sees `stop` in the decoded output."""
    for end in range(1, len(ids) + 1):
        if stop in tokenizer.decode(ids[:end], skip_special_tokens=True):
            return ids[:end]
    raise AssertionError(f"{stop!r} never appears")


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_full_decode(tokenizer: PreTrainedTokenizerBase,
                                            text: str) -> None:
    ids = tokenizer.encode(text)
    texts = feed(IncrementalDetokenizer(tokenizer), [[i] for i in ids])
    assert "".join(texts) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT_CHAR in chunk for chunk in texts)


@pytest.mark.parametrize("seed", range(4))
def test_random_chunks_match_full_decode(tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        sizes = [rng.randint(1, 4) for _ in ids]
        texts = feed(IncrementalDetokenizer(tokenizer), chunked(ids, sizes))
        assert "".join(texts) == text
        assert not any(REPLACEMENT_CHAR in chunk for chunk in texts)


def test_interleaved_batch_with_mixed_special_token_settings(
        tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    eos = tokenizer.eos_token_id
    requests = {f"r{i}": tokenizer.encode(text) + [eos] for i, text in enumerate(TEXTS)}
    skip = {rid: i % 2 == 0 for i, rid in enumerate(requests)}
    emitted = {rid: "" for rid in requests}
    for step in range(max(len(ids) for ids in requests.values())):
        batch = [out(rid, [ids[step]], LENGTH if step == len(ids) - 1 else None,
                     **({"skip_special_tokens": skip[rid]} if step == 0 else {}))
                 for rid, ids in requests.items() if step < len(ids)]
        for item, text in zip(batch, detok.detokenize(batch)):
            emitted[item.rid] += text
    for rid, ids in requests.items():
        assert emitted[rid] == tokenizer.decode(ids, skip_special_tokens=skip[rid])
    assert not detok.states


def test_stop_string_spanning_tokens_is_never_sent(tokenizer: PreTrainedTokenizerBase) -> None:
    stop = "\nUser:"
    ids = stopped_at(tokenizer, tokenizer.encode("The answer is 42.\nUser: next one"), stop)
    finish = FinishReason(kind="stop", matched_str=stop)
    texts = feed(IncrementalDetokenizer(tokenizer), [[i] for i in ids], finish, stop=[stop])
    assert "".join(texts) == "The answer is 42."
    assert texts[-1] == ""  # "\n" and "User" were held back, then dropped


def test_text_after_stop_string_is_dropped(tokenizer: PreTrainedTokenizerBase) -> None:
    stop = "wor"
    ids = tokenizer.encode("Hello world and more words")
    finish = FinishReason(kind="stop", matched_str=stop)
    detok = IncrementalDetokenizer(tokenizer)
    # The whole output arrives in one finishing chunk that runs past the stop string.
    assert feed(detok, [ids], finish, stop=[stop]) == ["Hello "]
    # Token by token, the scheduler stops at " world": its "ld" is dropped.
    ids = stopped_at(tokenizer, ids, stop)
    assert "".join(feed(detok, [[i] for i in ids], finish, stop=[stop])) == "Hello "


def test_held_back_stop_prefix_is_released(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("x\nUsers y")
    detok = IncrementalDetokenizer(tokenizer)
    first = detok.detokenize([out("r", ids[:2], stop=["\nUser:"])])
    assert first == ["x"]  # "\n" could start the stop string
    assert detok.detokenize([out("r", ids[2:3])]) == ["\nUsers"]
    assert detok.detokenize([out("r", ids[3:], LENGTH)]) == [" y"]


def test_stop_token_text_is_not_sent(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    eos = FinishReason(kind="stop", matched_token=tokenizer.eos_token_id)
    texts = feed(detok, [[i] for i in ids], eos, skip_special_tokens=False)
    assert "".join(texts) == "Hi there"
    period = tokenizer.encode(".")[0]
    ids = tokenizer.encode("One sentence") + [period]
    stop_token = FinishReason(kind="stop", matched_token=period)
    assert "".join(feed(detok, [ids[:-1], ids[-1:]], stop_token)) == "One sentence"


def test_prefix_is_context_only(tokenizer: PreTrainedTokenizerBase) -> None:
    prefix = tokenizer.encode("<|im_start|>assistant\nHello")
    texts = feed(IncrementalDetokenizer(tokenizer), [tokenizer.encode(" world")],
                 decode_prefix_ids=prefix)
    assert texts == [" world"]


def test_prefix_keeps_leading_space_of_sentencepiece_tokens() -> None:
    model = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()  # drops the space of a sequence's first word
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    detok = IncrementalDetokenizer(tokenizer)
    assert feed(detok, [[1], [1]]) == ["world", " world"]
    assert feed(detok, [[1], [1]], decode_prefix_ids=[0]) == [" world", " world"]


def test_states_are_capped_and_dropped_on_finish(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer, max_states=2)
    hello = tokenizer.encode("Hello")
    detok.detokenize([out("a", hello), out("b", hello)])
    detok.detokenize([out("c", hello)])
    assert list(detok.states) == ["b", "c"]
    assert detok.detokenize([out("b", [], LENGTH)]) == [""]
    assert detok.detokenize([out("a", hello, LENGTH)]) == ["Hello"]  # evicted: starts afresh
    assert list(detok.states) == ["c"]


def test_process_round_trip(model_path: str, tmp_path: Path,
                            tokenizer: PreTrainedTokenizerBase) -> None:
    endpoints = Endpoints(str(tmp_path))
    ctx = zmq.Context()
    api = pull_socket(ctx, endpoints.api_input)
    scheduler = push_socket(ctx, endpoints.detokenizer_input)
    spawn = multiprocessing.get_context("spawn")
    proc = spawn.Process(target=run_detokenizer,
                         args=(ServerArgs(model_path=model_path), ComponentArgs(str(tmp_path))))
    proc.start()
    try:
        assert api.poll(60_000), "no ComponentReady"
        assert recv(api) == ComponentReady(component="detokenizer")
        ids = tokenizer.encode("Ünïcode 😀 works")
        stop = FinishReason(kind="stop", matched_token=tokenizer.eos_token_id)
        send(scheduler, BatchTokenOut(outputs=[
            ReqTokenOut(rid="a", new_ids=ids[:4], finish=None, prompt_tokens=3,
                        completion_tokens=4, cached_tokens=1),
            ReqTokenOut(rid="b", new_ids=ids + [tokenizer.eos_token_id], finish=stop,
                        prompt_tokens=2, completion_tokens=len(ids) + 1, cached_tokens=0),
        ]))
        assert api.poll(10_000), "no BatchStrOut"
        reply = recv(api)
        assert isinstance(reply, BatchStrOut)
        a, b = reply.outputs
        assert (a.rid, a.text, a.new_ids, a.finish) == ("a", "Ünï", ids[:4], None)
        assert (a.prompt_tokens, a.completion_tokens, a.cached_tokens) == (3, 4, 1)
        assert (b.rid, b.text, b.finish) == ("b", "Ünïcode 😀 works", stop)
        proc.terminate()
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ctx.destroy(linger=0)
