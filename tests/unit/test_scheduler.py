"""The scheduler on CPU with a fake model: admission, chunking, retraction, stops, aborts."""

from __future__ import annotations

import pytest

from shoal.ipc.messages import AbortReq, FlushCacheReq, SchedulerInfoReq
from shoal.scheduler import admission
from tests.support.scheduler import (
    VOCAB,
    make_scheduler,
    request,
    run_overlapped_until_idle,
    run_until_idle,
)


def expected_tokens(last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = (last % (VOCAB - 1)) + 1
        out.append(last)
    return out


def test_generates_max_new_tokens_and_frees_everything() -> None:
    scheduler, io, _ = make_scheduler()
    io.inbox.append(request("a", [5, 6, 7], max_new=6))
    run_until_idle(scheduler)
    assert io.tokens("a") == expected_tokens(7, 6)
    assert io.finish("a").kind == "length"
    assert scheduler.memory.check_idle_integrity()
    assert scheduler.memory.num_free_req_pool_indices == 65


def test_non_streaming_request_gets_one_output_at_finish() -> None:
    scheduler, io, _ = make_scheduler()
    io.inbox.append(request("a", [1, 2], max_new=4, stream=False))
    run_until_idle(scheduler)
    assert len([o for o in io.outputs if o.rid == "a"]) == 1
    assert io.outputs[0].new_ids == expected_tokens(2, 4)
    assert io.outputs[0].completion_tokens == 4 and io.outputs[0].prompt_tokens == 2


def test_continuous_batching_admits_new_requests_while_others_decode() -> None:
    scheduler, io, model = make_scheduler()
    io.inbox.append(request("a", [1, 2, 3], max_new=20))
    for _ in range(3):
        scheduler.step()
    io.inbox.append(request("b", [10, 11], max_new=3))
    scheduler.step()
    # b's prefill ran in the same forward as a's decode step
    assert model.batches[-1].extend_lens == [1, 2]
    run_until_idle(scheduler)
    assert io.tokens("a") == expected_tokens(3, 20)
    assert io.tokens("b") == expected_tokens(11, 3)
    # b finished and left long before a
    finish_positions = [i for i, o in enumerate(io.outputs) if o.finish is not None]
    assert [io.outputs[i].rid for i in finish_positions] == ["b", "a"]


def test_chunked_prefill_interleaves_with_decode() -> None:
    scheduler, io, model = make_scheduler(chunk=16)
    io.inbox.append(request("short", [1], max_new=30))
    scheduler.step()
    io.inbox.append(request("long", list(range(1, 101)), max_new=2))
    run_until_idle(scheduler)
    chunk_batches = [b for b in model.batches if not b.is_decode]
    assert len(chunk_batches) >= 7  # 100 prompt tokens in chunks of at most 16 (minus decodes)
    assert all(b.num_tokens <= 16 + 1 for b in chunk_batches)
    # the short request decoded a token in every one of those steps
    assert all(b.batch_size == 2 for b in chunk_batches)
    assert io.tokens("long") == expected_tokens(100, 2)
    assert io.tokens("short") == expected_tokens(1, 30)


def test_retraction_under_a_small_pool_keeps_outputs_and_leaks_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # reserve almost nothing for future output, so admission overcommits and decode runs short
    monkeypatch.setattr(admission, "RESERVE_CLIP", 2)
    scheduler, io, _ = make_scheduler(num_slots=120, max_running=16)
    prompts = {f"r{i}": [i + 1] * 10 for i in range(8)}
    for rid, prompt in prompts.items():
        io.inbox.append(request(rid, prompt, max_new=40))
    run_until_idle(scheduler)
    for rid, prompt in prompts.items():
        assert io.tokens(rid) == expected_tokens(prompt[-1], 40), rid
    assert scheduler.num_retracted > 0
    assert scheduler.memory.check_idle_integrity()
    assert scheduler.memory.num_free_req_pool_indices == 17


def test_stop_token_and_eos() -> None:
    scheduler, io, _ = make_scheduler()
    io.inbox.append(request("stop", [3], max_new=10, stop_token_ids=[6]))
    io.inbox.append(request("eos", [VOCAB - 3], max_new=10))
    io.inbox.append(request("ignore", [VOCAB - 3], max_new=4, ignore_eos=True))
    run_until_idle(scheduler)
    assert io.tokens("stop") == [4, 5, 6]
    assert io.finish("stop").matched_token == 6
    # VOCAB-3 → VOCAB-2 → VOCAB-1 → 1 → ...: the counting model never emits EOS (0)
    assert io.finish("eos").kind == "length"
    assert io.tokens("ignore") == expected_tokens(VOCAB - 3, 4)


def test_stop_string() -> None:
    scheduler, io, _ = make_scheduler()
    # tokens 4, 5, 6 decode to "efg"
    io.inbox.append(request("s", [3], max_new=10, stop=["fg"]))
    run_until_idle(scheduler)
    assert io.tokens("s") == [4, 5, 6]
    assert io.finish("s").matched_str == "fg"


def test_stop_strings_completed_by_one_token_match_the_one_that_starts_first() -> None:
    scheduler, io, _ = make_scheduler()
    # token 6 ("g") completes both "fg" and "efg": the output ends before "efg"
    io.inbox.append(request("s", [3], max_new=10, stop=["fg", "efg"]))
    run_until_idle(scheduler)
    assert io.finish("s").matched_str == "efg"


def test_context_length_limits_generation() -> None:
    scheduler, io, _ = make_scheduler(context=16)
    io.inbox.append(request("a", list(range(1, 11)), max_new=100))
    io.inbox.append(request("too-long", list(range(1, 17)), max_new=1))
    run_until_idle(scheduler)
    assert len(io.tokens("a")) == 6
    assert io.finish("a").kind == "length"
    assert io.finish("too-long").kind == "abort"
    assert "context length" in io.finish("too-long").message


def test_abort_waiting_and_running_requests() -> None:
    scheduler, io, _ = make_scheduler(max_running=1)
    io.inbox += [request("running", [1], max_new=100), request("waiting", [2], max_new=100)]
    scheduler.step()
    io.inbox += [AbortReq(rid="waiting"), AbortReq(rid="running")]
    run_until_idle(scheduler)
    assert io.finish("waiting").kind == "abort"
    assert io.finish("running").kind == "abort"
    assert len(io.tokens("running")) < 100
    assert scheduler.memory.check_idle_integrity()


def test_shared_prefix_is_served_from_the_cache_with_the_same_output() -> None:
    prefix = list(range(1, 41))
    outputs = {}
    for radix in (True, False):
        scheduler, io, model = make_scheduler(radix=radix)
        io.inbox.append(request("first", prefix + [7], max_new=5))
        run_until_idle(scheduler)
        io.inbox.append(request("second", prefix + [9], max_new=5, stream=False))
        run_until_idle(scheduler)
        second = next(o for o in io.outputs if o.rid == "second")
        outputs[radix] = (io.tokens("first"), io.tokens("second"), second.cached_tokens,
                          model.batches[-5].num_tokens)
        assert scheduler.memory.check_idle_integrity()
    assert outputs[True][:2] == outputs[False][:2]
    assert outputs[True][2] == 40 and outputs[False][2] == 0
    assert outputs[True][3] == 1 and outputs[False][3] == 41  # the prefill computed 1 vs 41


def test_retraction_with_the_cache_recomputes_little_and_leaks_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "RESERVE_CLIP", 2)
    scheduler, io, _ = make_scheduler(num_slots=120, max_running=16)
    for i in range(8):
        io.inbox.append(request(f"r{i}", [i + 1] * 10, max_new=40))
    run_until_idle(scheduler)
    for i in range(8):
        assert io.tokens(f"r{i}") == expected_tokens(i + 1, 40)
    assert scheduler.num_retracted > 0
    assert scheduler.memory.check_idle_integrity()


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    scheduler, io, model = make_scheduler(max_running=1, policy="lpm")
    io.inbox.append(request("warm", list(range(1, 31)), max_new=1))
    run_until_idle(scheduler)
    io.inbox += [request("cold", [40, 41, 42], max_new=1),
                 request("hot", list(range(1, 31)) + [5], max_new=1)]
    run_until_idle(scheduler)
    finished = [o.rid for o in io.outputs if o.finish is not None]
    assert finished == ["warm", "hot", "cold"]


def test_flush_cache_is_refused_while_busy() -> None:
    scheduler, io, _ = make_scheduler()
    io.inbox.append(request("a", list(range(1, 21)), max_new=30))
    io.inbox.append(FlushCacheReq(rid="f1"))
    scheduler.step()
    assert io.replies[-1].ok is False and "cannot flush" in io.replies[-1].message
    run_until_idle(scheduler)
    assert scheduler.memory.cache.total_size > 0
    io.inbox.append(FlushCacheReq(rid="f2"))
    scheduler.step()
    assert io.replies[-1].ok is True
    assert scheduler.memory.cache.total_size == 0
    assert scheduler.memory.allocator.num_free == 4096
    io.inbox.append(SchedulerInfoReq(rid="i"))
    scheduler.step()
    assert io.replies[-1].info["num_free_slots"] == 4096


@pytest.mark.parametrize("radix", [True, False])
def test_overlap_loop_gives_the_same_tokens(radix: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "RESERVE_CLIP", 2)  # force retractions in both loops too
    results = []
    for overlap in (False, True):
        scheduler, io, model = make_scheduler(num_slots=160, max_running=16, chunk=16,
                                              radix=radix)
        io.inbox += [request(f"r{i}", [i + 1] * (5 + 7 * i), max_new=12 + i) for i in range(8)]
        io.inbox.append(request("stop", [3], max_new=10, stop_token_ids=[6]))
        if overlap:
            run_overlapped_until_idle(scheduler, io)
        else:
            run_until_idle(scheduler)
        assert scheduler.memory.check_idle_integrity()
        results.append({rid: io.tokens(rid) for rid in [f"r{i}" for i in range(8)] + ["stop"]})
        assert scheduler.num_retracted > 0
    assert results[0] == results[1]
    assert results[1]["stop"] == [4, 5, 6]
    assert results[1]["r7"] == expected_tokens(8, 19)


def test_requests_arriving_together_compute_a_shared_prefix_once() -> None:
    prefix = list(range(1, 41))
    prompts = {f"r{i}": prefix + [i + 1] for i in range(6)}
    results = {}
    for radix in (True, False):
        scheduler, io, model = make_scheduler(radix=radix)
        io.inbox += [request(rid, prompt, max_new=4, stream=False)
                     for rid, prompt in prompts.items()]
        run_until_idle(scheduler)
        assert scheduler.memory.check_idle_integrity()
        computed = sum(b.num_tokens for b in model.batches)
        cached = {o.rid: o.cached_tokens for o in io.outputs}
        results[radix] = ({rid: io.tokens(rid) for rid in prompts}, computed, cached)
    assert results[True][0] == results[False][0]
    # the first request computes the prefix; the others wait one step and find it cached, so
    # they compute their last prompt token only (plus 3 decode steps each in both runs)
    assert results[True][1] == 41 + 5 + 6 * 3 and results[False][1] == 6 * 41 + 6 * 3
    assert results[True][2] == {"r0": 0, **{f"r{i}": 40 for i in range(1, 6)}}


def test_a_prompt_is_shared_while_its_request_still_runs() -> None:
    scheduler, io, model = make_scheduler(chunk=16)
    long_prompt = list(range(1, 101))
    io.inbox.append(request("long", long_prompt, max_new=200))
    while not scheduler.running or scheduler.running[0].output_ids == []:
        scheduler.step()
    io.inbox.append(request("late", long_prompt[:60] + [7], max_new=3, stream=False))
    for _ in range(4):
        scheduler.step()
    late = next(o for o in io.outputs if o.rid == "late")
    assert late.cached_tokens == 60 and late.finish is not None
    assert any(r.rid == "long" for r in scheduler.running)  # served while "long" decodes
    run_until_idle(scheduler)
    assert io.tokens("long") == expected_tokens(100, 200)
    assert scheduler.memory.check_idle_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_shared_prefixes_under_retraction_keep_outputs_and_leak_nothing(
        overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "RESERVE_CLIP", 2)
    scheduler, io, _ = make_scheduler(num_slots=200, max_running=16, chunk=24)
    prompts = {f"r{i}": [9] * 30 + [i + 1] * (1 + i % 3) for i in range(10)}
    io.inbox += [request(rid, prompt, max_new=30) for rid, prompt in prompts.items()]
    if overlap:
        run_overlapped_until_idle(scheduler, io)
    else:
        run_until_idle(scheduler)
    for rid, prompt in prompts.items():
        assert io.tokens(rid) == expected_tokens(prompt[-1], 30), rid
    assert scheduler.num_retracted > 0
    assert scheduler.memory.check_idle_integrity()
