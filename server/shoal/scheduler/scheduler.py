"""The scheduler loop: receive → schedule → forward → process results, one step at a time."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from shoal.engine.sampler import SamplingWork
from shoal.ipc.messages import (
    AbortReq,
    AnyMessage,
    ComponentReady,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    GenerateReq,
    ReqTokenOut,
    SamplingResult,
    SchedulerInfoReq,
)
from shoal.metrics.scheduler_metrics import SchedulerSnapshot, SchedulerStats
from shoal.models.forward_batch import ForwardBatch
from shoal.scheduler.logits_plan import LogitsPlan, plan_logits
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.prefill import NewTokenRatio, PrefillAdder, future_slots
from shoal.scheduler.prefix_cache import common_prefix_len
from shoal.scheduler.request import Req
from shoal.scheduler.sampling import Sampling, local_sampling
from shoal.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)

DECODE_PREFIX_LEN = 5  # prompt ids sent to the detokenizer as decoding context


class SchedulerIO(Protocol):
    def recv(self, blocking: bool) -> list[AnyMessage]: ...
    def send_outputs(self, outputs: list[ReqTokenOut]) -> None: ...
    def send_ready(self, ready: ComponentReady) -> None: ...
    def send_reply(self, reply: ControlReply) -> None: ...


class Runner(Protocol):
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits at `batch.logits_at` ([batch, vocab] by default); None on a rank that does not
        hold them (an early PP stage)."""


@dataclass
class ScheduledBatch:
    rows: list[tuple[Req, int]]  # (request, tokens it computes this step)
    forward: ForwardBatch
    sampled: list[int]           # rows whose request samples a token after this step
    sampled_req_rows: list[int]  # their req_to_token rows when built (keys of the future map)
    epochs: list[int]            # each row's request epoch when built (stale rows are skipped)
    work: SamplingWork
    # decode rows whose input is the token a still-running batch samples (the overlap loop):
    # token positions in input_ids, and the request rows to read from the future-token map
    future_positions: list[int]
    future_rows: list[int]
    logits_plan: LogitsPlan | None = None  # None: the logits of each row's last token

    @property
    def has_prefill(self) -> bool:
        return any(n > 1 for _, n in self.rows)

    @property
    def needs_sync(self) -> bool:
        return self.logits_plan is not None or any(
            self.rows[i][0].needs_sync_sampling for i in self.sampled)


@dataclass(frozen=True)
class SchedulerConfig:
    context_length: int
    max_running_requests: int
    chunked_prefill_size: int
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest cached prefix first)


LPM_MAX_QUEUE = 128  # beyond this many waiting requests, lpm's matching costs more than it saves
# a waiting request sharing more than this many uncached tokens with a prompt being computed in
# this step waits for it (SGLang's IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD)
IN_BATCH_PREFIX_MIN = 32


class Scheduler:
    def __init__(self, runner: Runner, memory: ReqMemory, io: SchedulerIO,
                 stop_checker: StopChecker, config: SchedulerConfig,
                 sampling: Sampling = local_sampling,
                 record_event: Callable[[str], None] | None = None,
                 stats: SchedulerStats | None = None) -> None:
        self.runner = runner
        self.stats = stats  # rank 0 only: the periodic log line and gauges
        self.sampling = sampling
        self.record_event = record_event  # the rank consensus check, when enabled
        self.memory = memory
        self.io = io
        self.stop_checker = stop_checker
        self.config = config
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_forward_steps = 0
        self.num_retracted = 0
        self.new_token_ratio = NewTokenRatio()
        self.num_prompt_tokens = 0    # of admitted requests, for the cache hit rate
        self.num_cached_tokens = 0
        self.num_generated_tokens = 0
        self.should_stop = False
        self._checked_idle = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run_forever(self) -> None:
        while not self.should_stop:
            self.step()

    def run_forever_overlapped(self) -> None:
        """The overlap loop: step N+1 is scheduled and launched (forward and sampling, in a
        worker thread) before step N's results are processed, so result handling, streaming and
        scheduling run while the model computes. A decode row whose token step N is still
        sampling reads it from the future-token map when its forward starts. A batch whose
        sampling needs the output so far (penalties, logprobs) runs without overlap, and two
        prefill steps in a row are not overlapped, so the first one's first tokens go out
        before the next prefill is launched."""
        future_tokens = torch.zeros(self.memory.req_to_token.num_rows, dtype=torch.int64)
        inflight: tuple[ScheduledBatch, Future[SamplingResult]] | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") as worker:
            while not self.should_stop:
                for message in self.io.recv(blocking=not self.has_work and inflight is None):
                    self.handle(message)
                batch = self.schedule()
                if inflight is not None and batch is not None and (
                        batch.needs_sync or (batch.has_prefill and inflight[0].has_prefill)):
                    self._finish_step(*inflight)
                    inflight = None
                launched = None
                if batch is not None:
                    self._checked_idle = False
                    launched = (batch, worker.submit(self._compute, batch, future_tokens))
                if inflight is not None:
                    self._finish_step(*inflight)
                inflight = launched
                if inflight is not None and inflight[0].needs_sync:
                    self._finish_step(*inflight)
                    inflight = None
                if batch is None and inflight is None:
                    self._on_idle()

    def _compute(self, batch: ScheduledBatch, future_tokens: torch.Tensor) -> SamplingResult:
        """Worker thread: resolve pending input tokens, forward, sample, publish the tokens."""
        forward = batch.forward
        if batch.future_positions:
            forward.input_ids[batch.future_positions] = future_tokens[batch.future_rows].to(
                forward.input_ids.device)
        result = self._sample(batch, self.runner.forward(forward))
        if batch.sampled:
            future_tokens[batch.sampled_req_rows] = torch.tensor(result.tokens, dtype=torch.int64)
        return result

    def _finish_step(self, batch: ScheduledBatch, result: Future[SamplingResult]) -> None:
        self.num_forward_steps += 1
        self.process_results(batch, result.result())
        self._report()

    def step(self) -> None:
        for message in self.io.recv(blocking=not self.has_work):
            self.handle(message)
        batch = self.schedule()
        if batch is None:
            self._on_idle()
            return
        self._checked_idle = False
        logits = self.runner.forward(batch.forward)
        self.num_forward_steps += 1
        self.process_results(batch, self._sample(batch, logits))
        self._report()

    def _report(self) -> None:
        now = time.monotonic()
        if self.stats is not None and self.stats.due(now):
            self.stats.report(self.snapshot(), now)

    def snapshot(self) -> SchedulerSnapshot:
        total = self.memory.allocator.size
        return SchedulerSnapshot(
            num_running=len(self.running), num_queued=len(self.waiting),
            token_usage=(total - self.memory.num_available_slots) / total,
            cache_hit_rate=self.num_cached_tokens / max(self.num_prompt_tokens, 1),
            num_retracted=self.num_retracted, num_generated=self.num_generated_tokens)

    def _on_idle(self) -> None:
        """Once per idle period: with nothing running, every slot must be free or cached."""
        if not self.has_work and not self._checked_idle:
            self.memory.check_idle_integrity()
            self._checked_idle = True
            if self.stats is not None:
                self.stats.report(self.snapshot(), time.monotonic())

    def pool_info(self) -> dict[str, int]:
        allocator, cache = self.memory.allocator, self.memory.cache
        return {"num_total_slots": allocator.size, "num_free_slots": allocator.num_free,
                "num_cached_slots": cache.total_size,
                "num_evictable_slots": cache.evictable_size,
                "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "num_retracted_reqs": self.num_retracted,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens,
                "num_forward_steps": self.num_forward_steps}

    def describe_running(self) -> str:
        lines = [f"{len(self.running)} running, {len(self.waiting)} waiting, "
                 f"{self.num_forward_steps} forward passes"]
        lines += [f"  {r.rid}: prompt {len(r.input_ids)}, output {len(r.output_ids)}, "
                  f"cached {r.cached_len}" for r in self.running]
        return "\n".join(lines)

    # -- requests in ------------------------------------------------------------------------

    def handle(self, message: AnyMessage) -> None:
        if isinstance(message, GenerateReq):
            self._add_request(message)
        elif isinstance(message, AbortReq):
            self._abort(message.rid)
        elif isinstance(message, FlushCacheReq):
            self._flush_cache(message.rid)
        elif isinstance(message, SchedulerInfoReq):
            self.io.send_reply(ControlReply(rid=message.rid, ok=True, info=self.pool_info()))
        else:
            logger.warning("scheduler ignores unexpected message %s", type(message).__name__)

    def _add_request(self, message: GenerateReq) -> None:
        req = Req.from_message(message, self.stop_checker.eos_token_ids)
        problem = self._validate(req)
        if problem:
            req.finish = FinishReason(kind="abort", message=problem)
            self.io.send_outputs([self._output(req)])
            return
        self.waiting.append(req)

    def _validate(self, req: Req) -> str | None:
        if not req.input_ids:
            return "the prompt is empty"
        if len(req.input_ids) >= self.config.context_length:
            return (f"the prompt ({len(req.input_ids)} tokens) is longer than the model's context "
                    f"length ({self.config.context_length} tokens)")
        if len(req.input_ids) + req.sampling.max_new_tokens > self.memory.allocator.size:
            return (f"the prompt plus max_new_tokens ({len(req.input_ids)} + "
                    f"{req.sampling.max_new_tokens}) exceed the KV cache pool "
                    f"({self.memory.allocator.size} tokens)")
        return None

    def _abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish = FinishReason(kind="abort", message="aborted")
                self.memory.release(req)
                self.io.send_outputs([self._output(req)])
        for req in self.running:
            if req.rid == rid and req.finish is None:
                req.finish = FinishReason(kind="abort", message="aborted")

    def _flush_cache(self, rid: str) -> None:
        if self.has_work:
            self.io.send_reply(ControlReply(rid=rid, ok=False, message=(
                f"cannot flush the cache while {len(self.running)} requests run and "
                f"{len(self.waiting)} wait")))
            return
        self.memory.flush_cache()
        self.io.send_reply(ControlReply(rid=rid, ok=True))

    # -- scheduling -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self._finish_aborted()
        # a request whose last token is still being sampled (the overlap loop) waits for it
        decoding = [r for r in self.running if r.extend_len == 1 and r.remaining_new_tokens > 0
                    and r.fill_len < self.config.context_length]
        decoding = self._make_room_for(decoding)
        if decoding:
            self.new_token_ratio.on_step()
        ratio = self.new_token_ratio.value
        available = self.memory.num_available_slots
        adder = PrefillAdder(
            token_budget=self.config.chunked_prefill_size,
            free_slots=available - len(decoding),
            unreserved_slots=available - sum(future_slots(r, ratio) for r in self.running),
            free_rows=min(self.memory.num_free_rows,
                          self.config.max_running_requests - len(self.running)),
            new_token_ratio=ratio)
        for req in self.running:
            if req.extend_len > 1 and not adder.add_chunk(req):
                break
        self._admit(adder)
        rows = [(r, 1) for r in decoding] + adder.rows
        if not rows:
            return None
        if self.record_event is not None:
            self.record_event("batch " + " ".join(f"{r.rid}+{n}@{r.cached_len}" for r, n in rows))
        return self._build(rows)

    def _admit(self, adder: PrefillAdder) -> None:
        """Admit waiting requests in policy order until one does not fit. A request that shares
        more than it has cached with a prompt this step computes waits a step instead, and then
        finds those tokens in the cache (SGLang's in-batch prefix caching)."""
        if self.config.schedule_policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            matched = {id(r): len(self.memory.match_prefix(r).slots) for r in self.waiting}
            self.waiting = deque(sorted(self.waiting, key=lambda r: -matched[id(r)]))
        deferred: list[Req] = []
        while self.waiting:
            req = self.waiting[0]
            match = self.memory.match_prefix(req)
            if self._computed_in_this_step(req, len(match.slots), adder):
                deferred.append(self.waiting.popleft())
                continue
            if adder.try_admit(req, len(match.slots)) is None:
                break
            self.waiting.popleft()
            first_admission = not req.was_admitted
            self.memory.admit(req, match)
            self.running.append(req)
            if first_admission:
                self.num_prompt_tokens += len(req.input_ids)
                self.num_cached_tokens += req.cached_tokens
            if self.record_event is not None:
                self.record_event(f"admit {req.rid} prefix={len(match.slots)}")
        self.waiting.extendleft(reversed(deferred))

    def _computed_in_this_step(self, req: Req, cached: int, adder: PrefillAdder) -> bool:
        """Whether a prefill row of this step computes more than `IN_BATCH_PREFIX_MIN` of the
        tokens `req` would compute beyond its `cached` prefix."""
        if not self.memory.cache.shares:
            return False
        ids = req.fill_ids[:req.max_prefix_match_len]
        return any(
            min(common_prefix_len(ids, other.fill_ids), other.cached_len + n) - cached
            > IN_BATCH_PREFIX_MIN for other, n in adder.rows)

    def _make_room_for(self, decoding: list[Req]) -> list[Req]:
        """Retract the least-advanced requests until every remaining decode row has a slot."""
        while len(decoding) > self.memory.num_available_slots and len(self.running) > 1:
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            self.running.remove(victim)
            self.memory.release(victim)
            self.waiting.appendleft(victim)
            self.num_retracted += 1
            self.new_token_ratio.on_retract()
            if self.record_event is not None:
                self.record_event(f"retract {victim.rid}")
            logger.info("KV pool full: retracted %s (%d output tokens so far)", victim.rid,
                        len(victim.output_ids))
            decoding = [r for r in decoding if r is not victim]
        return decoding

    def _build(self, rows: list[tuple[Req, int]]) -> ScheduledBatch:
        """The step's tensors; each request's progress advances now, before the forward runs, so
        the overlap loop can schedule the next step while this one computes."""
        reqs = [r for r, _ in rows]
        extend_lens = [n for _, n in rows]
        out_cache_loc = self.memory.alloc_slots(reqs, extend_lens)
        input_ids: list[int] = []
        positions: list[int] = []
        future_positions: list[int] = []
        future_rows: list[int] = []
        for req, n in rows:
            start = req.cached_len
            if n == 1 and req.num_pending:
                future_positions.append(len(input_ids))
                future_rows.append(req.row)  # type: ignore[arg-type]
                input_ids.append(0)
            elif n == 1 and req.output_ids:
                input_ids.append(req.output_ids[-1])
            else:
                input_ids += req.fill_ids[start:start + n]
            positions += range(start, start + n)
        device = out_cache_loc.device
        forward = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            out_cache_loc=out_cache_loc,
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=device),
            seq_lens=torch.tensor([r.cached_len + n for r, n in rows], dtype=torch.int64,
                                  device=device),
            extend_lens=extend_lens)
        plan = plan_logits(rows)
        if plan is not None:
            forward.logit_indices = torch.tensor(plan.indices, dtype=torch.int64, device=device)
        sampled = [i for i, (req, n) in enumerate(rows) if req.cached_len + n == req.fill_len]
        for req, n in rows:
            req.cached_len += n
        for i in sampled:
            rows[i][0].num_pending += 1
        sampled_reqs = [rows[i][0] for i in sampled]
        logit_rows = [plan.last_rows[i] for i in sampled] if plan else sampled
        work = SamplingWork(sampled_reqs, logit_rows, plan.slices if plan else [])
        return ScheduledBatch(rows=rows, forward=forward, sampled=sampled,
                              sampled_req_rows=[r.row for r in sampled_reqs],  # type: ignore[misc]
                              epochs=[r.epoch for r in reqs], work=work,
                              future_positions=future_positions, future_rows=future_rows,
                              logits_plan=plan)

    # -- results out ------------------------------------------------------------------------

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> SamplingResult:
        if not batch.work.reqs and not batch.work.prompt:
            return SamplingResult(tokens=[])
        return self.sampling(logits, batch.work)

    def process_results(self, batch: ScheduledBatch, result: SamplingResult) -> None:
        """Append each sampled token, check stops, stream, and release finished requests. Rows
        of requests that gave their KV back since the batch was built (finished, aborted or
        retracted while it ran) are stale: their tokens are dropped."""
        if batch.logits_plan is not None:
            batch.logits_plan.record(result.prompt_logprobs)
        logprobs = result.logprobs or [None] * len(batch.sampled)
        appended = []
        for i, token, token_logprobs in zip(batch.sampled, result.tokens, logprobs):
            req = batch.rows[i][0]
            if req.epoch != batch.epochs[i] or req.finish is not None:
                continue
            req.num_pending -= 1
            req.output_ids.append(token)
            if token_logprobs is not None and req.output_logprobs is not None:
                req.output_logprobs.extend(token_logprobs)
            req.finish = self.stop_checker.check(req)
            appended.append(req)
        for (req, n), epoch in zip(batch.rows, batch.epochs):
            if n > 1 and req.epoch == epoch and req.finish is None:
                self.memory.cache_progress(req)
        self.num_generated_tokens += len(appended)
        self.io.send_outputs([self._output(r) for r in appended
                              if r.stream or r.finish is not None])
        self._release_finished()

    def _finish_aborted(self) -> None:
        aborted = [r for r in self.running if r.finish is not None]
        if aborted:
            self.io.send_outputs([self._output(r) for r in aborted])
            self._release_finished()

    def _release_finished(self) -> None:
        still_running = []
        for req in self.running:
            if req.finish is None:
                still_running.append(req)
            else:
                self.memory.release(req)
        self.running = still_running

    def _output(self, req: Req) -> ReqTokenOut:
        first = req.num_sent_ids == 0
        new_ids = req.output_ids[req.num_sent_ids:]
        logprobs = (None if req.output_logprobs is None
                    else req.output_logprobs.slice(req.num_sent_ids))
        req.num_sent_ids = len(req.output_ids)
        return ReqTokenOut(
            rid=req.rid, new_ids=new_ids, finish=req.finish,
            prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            skip_special_tokens=req.sampling.skip_special_tokens,
            decode_prefix_ids=req.input_ids[-DECODE_PREFIX_LEN:] if first else [],
            stop=req.sampling.stop if first else [],
            logprobs=logprobs, prompt_logprobs=req.prompt_logprobs if first else None)
