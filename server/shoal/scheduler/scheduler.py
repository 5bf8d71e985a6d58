"""The scheduler loop: receive → schedule → forward → process results, one step at a time.

Where is ... (docs/architecture.md has the same index; a test resolves every name):

    admission       Scheduler._admit → admission.PrefillAdder.try_admit (its budget:
                    admission.future_slots, admission.NewTokenRatio) → memory.ReqMemory.acquire;
                    checked before queueing: Scheduler._validate
    eviction        memory.ReqMemory.evict_for, called by Scheduler._forward_batch before
                    memory.ReqMemory.alloc_slots → prefix_cache.RadixCache.evict
    retraction      Scheduler._retract_for_decode → memory.ReqMemory.release
    progress        Scheduler._advance_progress, when a batch is built
    shared prompts  memory.ReqMemory.cache_progress, from Scheduler.process_results;
                    in-batch deferral: Scheduler._computed_in_this_step
    overlap         Scheduler.run_forever_overlapped (_must_finish_first decides what waits);
                    the worker runs Scheduler._compute, which fills the future-token map
                    (FutureInputs)
    disaggregation  roles.Role, called by Scheduler.schedule and Scheduler.process_results:
                    prefill_role.PrefillRole, decode_role.DecodeRole, roles.ColocatedRole
    speculation     Scheduler._propose (speculation.NgramProposer), when a batch is built;
                    Scheduler._verify → speculation.verify; Scheduler._take_verified
    grammars        Scheduler._attach_grammar → grammar.Grammars.matcher (the engine's
                    sampler applies the mask); each processed token: grammar.accept

A batch is a list of entries (request, tokens it computes this step); a request's place in the
req_to_token table is its `req_pool_idx`; "row" is left to the rows of the logits. Progress
advances when a batch is built (`_advance_progress`), not when its forward ends.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
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
from shoal.scheduler import grammar
from shoal.scheduler.admission import NewTokenRatio, PrefillAdder, future_slots
from shoal.scheduler.grammar import Grammars
from shoal.scheduler.logits_plan import LogitsPlan, Verification, plan_logits, plan_verification
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.prefix_cache import common_prefix_len
from shoal.scheduler.request import Req
from shoal.scheduler.roles import ColocatedRole, Role
from shoal.scheduler.sampling import Sampling, local_sampling
from shoal.scheduler.speculation import NgramProposer, grammar_masked, grammar_prefix, verify
from shoal.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)

DECODE_PREFIX_LEN = 5  # prompt ids sent to the detokenizer as decoding context

Entry = tuple[Req, int]  # a request and the tokens it computes this step (proposals included)


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
class FutureInputs:
    """Decode entries whose input is the token a still-running batch samples (the overlap loop):
    their positions in `input_ids`, and the req_pool_idx to read each from the future-token map
    when the forward starts."""

    positions: list[int] = field(default_factory=list)
    req_pool_indices: list[int] = field(default_factory=list)


@dataclass
class ScheduledBatch:
    entries: list[Entry]
    forward: ForwardBatch
    sampled: list[int]                   # entries whose request samples a token after this step
    sampled_req_pool_indices: list[int]  # their req_pool_idx when built (the future map's keys)
    epochs: list[int]                    # each entry's request epoch when built (stale: skipped)
    work: SamplingWork
    future: FutureInputs
    logits_plan: LogitsPlan | None = None  # None: the logits of each entry's last token
    verification: Verification = field(default_factory=Verification)
    verified: list[list[int]] = field(default_factory=list)  # per verifying entry, its tokens

    @property
    def has_prefill(self) -> bool:
        return any(n > 1 for _, n in self.entries)

    @property
    def blocks_overlap(self) -> bool:
        """Its sampling reads the output so far (penalties) or scores prompt positions: the
        overlap loop runs it to the end before scheduling the next step."""
        return self.logits_plan is not None or any(
            self.entries[i][0].needs_sync_sampling for i in self.sampled)


Launched = tuple[ScheduledBatch, Future[SamplingResult]]  # a batch and its sampling, running


def _must_finish_first(inflight: ScheduledBatch, batch: ScheduledBatch) -> bool:
    """Whether the overlap loop finishes the in-flight step before launching `batch`: when
    `batch` blocks overlap, or both are prefills (so the first prefill's first tokens go out
    before the next prefill runs)."""
    return batch.blocks_overlap or (batch.has_prefill and inflight.has_prefill)


@dataclass(frozen=True)
class SchedulerConfig:
    context_length: int
    max_running_requests: int
    chunked_prefill_size: int
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest cached prefix first)
    speculation: NgramProposer | None = None  # plain loop, one rank, colocated only


LPM_MAX_QUEUE = 128  # beyond this many waiting requests, lpm's matching costs more than it saves
# a waiting request sharing more than this many uncached tokens with a prompt being computed in
# this step waits for it (SGLang's IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD)
IN_BATCH_PREFIX_MIN = 32
ROLE_WAIT_S = 0.02  # idle but for transfers: how long to wait for one before reading requests


class Scheduler:
    def __init__(self, runner: Runner, memory: ReqMemory, io: SchedulerIO,
                 stop_checker: StopChecker, config: SchedulerConfig,
                 sampling: Sampling = local_sampling,
                 record_event: Callable[[str], None] | None = None,
                 stats: SchedulerStats | None = None, role: Role | None = None,
                 grammars: Grammars | None = None) -> None:
        self.runner = runner
        self.grammars = grammars  # structured outputs; None: constrained requests are refused
        self.role = role or ColocatedRole()  # prefill/decode disaggregation (roles.py)
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
        self.num_prompt_tokens = 0       # of admitted requests, for the cache hit rate
        self.num_prefix_hit_tokens = 0   # of those, served from the prefix cache
        self.num_generated_tokens = 0
        self.num_verify_steps = 0       # speculative decoding: request-steps that verified
        self.num_verified_tokens = 0    # tokens those steps yielded (accepted + the target's)
        self.should_stop = False
        self._checked_idle = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def is_idle(self) -> bool:
        """Nothing to compute, and no request waiting on a transfer."""
        return not self.has_work and not self.role.has_work

    def run_forever(self) -> None:
        while not self.should_stop:
            self.step()

    def step(self) -> None:
        for message in self.io.recv(blocking=self.is_idle):
            self.handle(message)
        batch = self.schedule()
        if batch is None:
            self._on_idle()
            return
        logits = self.runner.forward(batch.forward)
        result = self._sample(batch, logits)
        batch.verified = self._verify(batch, logits)
        self._finish_step(batch, result)

    def run_forever_overlapped(self) -> None:
        """The overlap loop: step N+1 is scheduled and launched (forward and sampling, in a
        worker thread) before step N's results are processed, so result handling, streaming and
        scheduling run while the model computes. A decode entry whose token step N is still
        sampling reads it from the future-token map when its forward starts."""
        assert self.config.speculation is None, "speculative decoding runs the plain loop"
        future_tokens = torch.zeros(self.memory.req_to_token.num_rows, dtype=torch.int64)
        inflight: Launched | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") as worker:
            while not self.should_stop:
                for message in self.io.recv(blocking=self.is_idle and inflight is None):
                    self.handle(message)
                batch = self.schedule()
                if inflight is not None and (batch is None
                                             or _must_finish_first(inflight[0], batch)):
                    self._finish_step(inflight[0], inflight[1].result())
                    inflight = None
                if batch is None:
                    self._on_idle()
                    continue
                launched = (batch, worker.submit(self._compute, batch, future_tokens))
                if inflight is not None:  # while `batch` computes
                    self._finish_step(inflight[0], inflight[1].result())
                inflight = launched
                if batch.blocks_overlap:
                    self._finish_step(batch, launched[1].result())
                    inflight = None

    def _compute(self, batch: ScheduledBatch, future_tokens: torch.Tensor) -> SamplingResult:
        """Worker thread: resolve pending input tokens, forward, sample, publish the tokens."""
        forward, future = batch.forward, batch.future
        if future.positions:
            forward.input_ids[future.positions] = future_tokens[future.req_pool_indices].to(
                forward.input_ids.device)
        result = self._sample(batch, self.runner.forward(forward))
        if batch.sampled:
            future_tokens[batch.sampled_req_pool_indices] = torch.tensor(result.tokens,
                                                                         dtype=torch.int64)
        return result

    def _finish_step(self, batch: ScheduledBatch, result: SamplingResult) -> None:
        self.num_forward_steps += 1
        self.process_results(batch, result)
        self._report()

    def _report(self) -> None:
        now = time.monotonic()
        if self.stats is not None and self.stats.due(now):
            self.stats.report(self.snapshot(), now)

    def snapshot(self) -> SchedulerSnapshot:
        allocator, cache = self.memory.allocator, self.memory.cache
        return SchedulerSnapshot(
            num_total_slots=allocator.size, num_free_slots=allocator.num_free,
            num_cached_slots=cache.total_size, num_evictable_slots=cache.evictable_size,
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            num_retracted_reqs=self.num_retracted, num_prompt_tokens=self.num_prompt_tokens,
            num_prefix_hit_tokens=self.num_prefix_hit_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_forward_steps=self.num_forward_steps, num_verify_steps=self.num_verify_steps,
            num_verified_tokens=self.num_verified_tokens)

    def _on_idle(self) -> None:
        """Once per idle period: with nothing running, every slot must be free or cached."""
        if self.role.has_work:
            self.role.wait(ROLE_WAIT_S)
        elif not self.has_work and not self._checked_idle:
            self.memory.check_idle_integrity()
            self._checked_idle = True
            if self.stats is not None:
                self.stats.report(self.snapshot(), time.monotonic())

    def describe_running(self) -> str:
        lines = [f"{len(self.running)} running, {len(self.waiting)} waiting, "
                 f"{self.num_forward_steps} forward passes"]
        lines += [f"  {r.rid}: prompt {len(r.input_ids)}, output {len(r.output_ids)}, "
                  f"computed {r.computed_len}" for r in self.running]
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
            self.io.send_reply(ControlReply(rid=message.rid, ok=True,
                                            info={**asdict(self.snapshot()),
                                                  **self.role.info()}))
        else:
            logger.warning("scheduler ignores unexpected message %s", type(message).__name__)

    def _add_request(self, message: GenerateReq) -> None:
        req = Req.from_message(message, self.stop_checker.eos_token_ids)
        problem = self._validate(req) or self._attach_grammar(req)
        if problem:
            req.finish = FinishReason(kind="abort", message=problem, refused=True)
            self.io.send_outputs([self._output(req)])
            return
        if not self.role.accept(req, message.bootstrap):
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

    def _attach_grammar(self, req: Req) -> str | None:
        """Give a constrained request its grammar matcher; what is wrong when it cannot."""
        if not req.sampling.is_constrained:
            return None
        if self.grammars is None:
            return "structured outputs are not served by this scheduler"
        if not isinstance(self.role, ColocatedRole):
            return "structured outputs are not served with prefill/decode disaggregation"
        try:
            req.grammar = self.grammars.matcher(req.sampling)
        except ValueError as exc:
            return str(exc)
        return None

    def _abort(self, rid: str) -> None:
        dropped = self.role.abort(rid)
        if dropped:
            self.io.send_outputs([self._output(r) for r in dropped])
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
        if not self.is_idle:
            self.io.send_reply(ControlReply(rid=rid, ok=False, message=(
                f"cannot flush the cache while {len(self.running)} requests run and "
                f"{len(self.waiting)} wait")))
            return
        self.memory.flush_cache()
        self.io.send_reply(ControlReply(rid=rid, ok=True))

    # -- scheduling -------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        moved = self.role.before_schedule(self)
        if moved:
            self.io.send_outputs([self._output(r) for r in moved])
        self._finish_aborted()
        # a request whose last token is still being sampled (the overlap loop) waits for it
        decoding = [r for r in self.running if r.extend_len == 1 and r.remaining_new_tokens > 0
                    and r.total_len < self.config.context_length]
        decoding = self._retract_for_decode(decoding)
        proposals = self._propose(decoding)
        if decoding:
            self.new_token_ratio.on_step()
        ratio = self.new_token_ratio.value
        available = self.memory.num_available_slots
        adder = PrefillAdder(
            token_budget=self.config.chunked_prefill_size,
            free_slots=available - len(decoding) - sum(map(len, proposals)),
            unreserved_slots=available - sum(future_slots(r, ratio) for r in self.running),
            free_req_pool_indices=min(self.memory.num_free_req_pool_indices,
                                      self.config.max_running_requests - len(self.running)),
            new_token_ratio=ratio)
        for req in self.running:
            if req.extend_len > 1 and not adder.add_chunk(req):
                break
        self._admit(adder)
        if any(r.needs_prompt_logprobs for r, _ in adder.entries):
            proposals = [[] for _ in decoding]  # one logits plan per batch: prompt logprobs'
        entries = [(r, 1 + len(p)) for r, p in zip(decoding, proposals)] + adder.entries
        proposals += [[] for _ in adder.entries]
        if not entries:
            return None
        if self.record_event is not None:
            self.record_event("batch " + " ".join(f"{r.rid}+{n}@{r.computed_len}"
                                                  for r, n in entries))
        self._checked_idle = False
        return self._build(entries, proposals)

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
            self.memory.acquire(req, match)
            self.running.append(req)
            if first_admission:
                self.num_prompt_tokens += len(req.input_ids)
                self.num_prefix_hit_tokens += req.prefix_hit_len
            if self.record_event is not None:
                self.record_event(f"admit {req.rid} prefix={len(match.slots)}")
        self.waiting.extendleft(reversed(deferred))

    def _computed_in_this_step(self, req: Req, cached: int, adder: PrefillAdder) -> bool:
        """Whether a prefill entry of this step computes more than `IN_BATCH_PREFIX_MIN` of the
        tokens `req` would compute beyond its `cached` prefix."""
        if not self.memory.cache.shares:
            return False
        ids = req.token_ids[:req.max_prefix_match_len]
        return any(
            min(common_prefix_len(ids, other.token_ids), other.computed_len + n) - cached
            > IN_BATCH_PREFIX_MIN for other, n in adder.entries)

    def _retract_for_decode(self, decoding: list[Req]) -> list[Req]:
        """Retract the least-advanced requests until every remaining decode entry has a slot;
        a retracted request goes back to the front of the queue (`ReqMemory.release` caches
        what it computed)."""
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

    def _propose(self, decoding: list[Req]) -> list[list[int]]:
        """Each decode entry's proposed tokens (speculative decoding), as many as its
        remaining tokens, the context and the free slots allow; [] for a request that does not
        speculate (opted out, or its sampling reads more than one token's logits); with a
        grammar, only the part of the proposal the grammar accepts."""
        proposer = self.config.speculation
        if proposer is None:
            return [[] for _ in decoding]
        spare = self.memory.num_available_slots - len(decoding)
        proposals = []
        for req in decoding:
            proposal: list[int] = []
            if req.speculates and not req.num_pending:
                limit = min(req.remaining_new_tokens - 1, spare,
                            self.config.context_length - req.total_len - 1)
                proposal = proposer.propose(req.token_ids, limit)
                if req.grammar is not None:
                    proposal = grammar_prefix(req.grammar, proposal)
            spare -= len(proposal)
            proposals.append(proposal)
        return proposals

    def _build(self, entries: list[Entry], proposals: list[list[int]]) -> ScheduledBatch:
        """The step's batch: its tensors, then each request's progress advances (now, before the
        forward runs, so the overlap loop can schedule the next step while this one computes),
        then what sampling does. Entries with a proposal verify it instead of sampling."""
        plan = plan_logits(entries)
        verification = plan_verification(entries, proposals)
        forward, future = self._forward_batch(entries, proposals, plan, verification)
        sampled = self._advance_progress(entries, proposals)
        sampled = [i for i in sampled if not proposals[i]]
        sampled_reqs = [entries[i][0] for i in sampled]
        if plan:
            logit_rows = [plan.last_rows[i] for i in sampled]
        elif verification.entries:
            logit_rows = [verification.last_rows[i] for i in sampled]
        else:
            logit_rows = sampled
        return ScheduledBatch(
            entries=entries, forward=forward, sampled=sampled,
            sampled_req_pool_indices=[_req_pool_idx(r) for r in sampled_reqs],
            epochs=[r.epoch for r, _ in entries],
            work=SamplingWork(sampled_reqs, logit_rows, plan.slices if plan else []),
            future=future, logits_plan=plan, verification=verification)

    def _forward_batch(self, entries: list[Entry], proposals: list[list[int]],
                       plan: LogitsPlan | None, verification: Verification
                       ) -> tuple[ForwardBatch, FutureInputs]:
        """The forward's tensors, with each entry's new slots taken (evicting cached prefixes
        first when the free list is short) and written into its req_to_token entry."""
        reqs = [r for r, _ in entries]
        extend_lens = [n for _, n in entries]
        self.memory.evict_for(sum(extend_lens))
        out_cache_loc = self.memory.alloc_slots(reqs, extend_lens)
        input_ids: list[int] = []
        positions: list[int] = []
        future = FutureInputs()
        for (req, n), proposal in zip(entries, proposals):
            start = req.computed_len
            if proposal:
                input_ids += [req.token_ids[start], *proposal]
            elif n == 1 and req.num_pending:
                future.positions.append(len(input_ids))
                future.req_pool_indices.append(_req_pool_idx(req))
                input_ids.append(0)
            elif n == 1 and req.output_ids:
                input_ids.append(req.output_ids[-1])
            else:
                input_ids += req.token_ids[start:start + n]
            positions += range(start, start + n)
        device = out_cache_loc.device
        forward = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            out_cache_loc=out_cache_loc,
            req_pool_indices=torch.tensor([_req_pool_idx(r) for r in reqs], dtype=torch.int64,
                                          device=device),
            seq_lens=torch.tensor([r.computed_len + n for r, n in entries], dtype=torch.int64,
                                  device=device),
            extend_lens=extend_lens)
        if plan is not None:
            forward.logit_indices = torch.tensor(plan.indices, dtype=torch.int64, device=device)
        else:
            if verification.entries:
                forward.logit_indices = torch.tensor(verification.indices, dtype=torch.int64,
                                                     device=device)
            forward.argmax_only = all(r.sampling.is_greedy and not r.needs_sync_sampling
                                      for r in reqs)
        return forward, future

    @staticmethod
    def _advance_progress(entries: list[Entry], proposals: list[list[int]]) -> list[int]:
        """Move each request's `computed_len` past this step's tokens (vLLM's
        `_update_after_schedule`), proposed tokens not included (they count once accepted); an
        entry that reaches `total_len` samples a token, pending until the step's results are
        processed. Returns those entries."""
        extends = [n - len(p) for (_, n), p in zip(entries, proposals)]
        sampled = [i for i, ((req, _), n) in enumerate(zip(entries, extends))
                   if req.computed_len + n == req.total_len]
        for (req, _), n in zip(entries, extends):
            req.computed_len += n
        for i in sampled:
            entries[i][0].num_pending += 1
        return sampled

    # -- results out ------------------------------------------------------------------------

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> SamplingResult:
        if not batch.work.reqs and not batch.work.prompt:
            return SamplingResult(tokens=[])
        return self.sampling(logits, batch.work)

    @staticmethod
    def _verify(batch: ScheduledBatch, logits: torch.Tensor | None) -> list[list[int]]:
        """The tokens each verifying entry yields (one rank: it holds the logits); a
        request's grammar masks each position as its state after the proposals before it."""
        verification = batch.verification
        if not verification.entries:
            return []
        assert logits is not None
        verified = []
        for i, proposal, rows in zip(verification.entries, verification.proposals,
                                     verification.rows):
            req = batch.entries[i][0]
            step_logits = logits[rows]
            if req.grammar is not None:
                step_logits = grammar_masked(step_logits, req.grammar, proposal)
            verified.append(verify(step_logits, proposal, req.sampling, req.generator))
        return verified

    def process_results(self, batch: ScheduledBatch, result: SamplingResult) -> None:
        """Append each sampled token, check stops, stream, and release finished requests.
        Entries of requests that gave their KV back since the batch was built (finished,
        aborted or retracted while it ran) are stale: their tokens are dropped."""
        if batch.logits_plan is not None:
            batch.logits_plan.record(result.prompt_logprobs)
        logprobs = result.logprobs or [None] * len(batch.sampled)
        appended = []
        num_tokens = 0
        for i, token, token_logprobs in zip(batch.sampled, result.tokens, logprobs):
            req = batch.entries[i][0]
            if req.epoch != batch.epochs[i] or req.finish is not None:
                continue
            req.num_pending -= 1
            req.append_token(token)
            grammar_end = grammar.accept(req, token)
            if token_logprobs is not None and req.output_logprobs is not None:
                req.output_logprobs.extend(token_logprobs)
            req.finish = self.stop_checker.check(req) or grammar_end
            appended.append(req)
            num_tokens += 1
        for i, tokens in zip(batch.verification.entries, batch.verified):
            req = batch.entries[i][0]
            if req.epoch == batch.epochs[i] and req.finish is None:
                num_tokens += self._take_verified(req, batch.entries[i][1], tokens)
                appended.append(req)
        for (req, n), epoch in zip(batch.entries, batch.epochs):
            if n > 1 and req.epoch == epoch and req.finish is None:
                self.memory.cache_progress(req)
        held = self.role.after_step(batch, appended)
        self.num_generated_tokens += num_tokens
        self.io.send_outputs([self._output(r) for r in appended
                              if (r.stream or r.finish is not None) and r.rid not in held])
        self._release_finished()

    def _take_verified(self, req: Req, extend: int, tokens: list[int]) -> int:
        """Append a verify step's tokens one at a time, stopping at the first that finishes
        the request; the KV of the accepted ones counts as computed, and the slots written for
        the rest (the rejected proposals) go back to the free list. Returns how many it
        appended."""
        req.num_pending -= 1
        start = req.computed_len - 1  # the step computed positions [start, start + extend)
        for token in tokens:
            req.append_token(token)
            grammar_end = grammar.accept(req, token)
            req.finish = self.stop_checker.check(req) or grammar_end
            if req.finish is not None:
                break
        req.computed_len = len(req.token_ids) - 1
        self.memory.free_tail(req, start + extend)
        num_tokens = len(req.token_ids) - 1 - start
        self.num_verify_steps += 1
        self.num_verified_tokens += num_tokens
        return num_tokens

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
            cached_tokens=req.prefix_hit_len,
            skip_special_tokens=req.sampling.skip_special_tokens,
            decode_prefix_ids=req.input_ids[-DECODE_PREFIX_LEN:] if first else [],
            stop=req.sampling.stop if first else [],
            logprobs=logprobs, prompt_logprobs=req.prompt_logprobs if first else None)


def _req_pool_idx(req: Req) -> int:
    assert req.req_pool_idx is not None, "a scheduled request holds a req_to_token entry"
    return req.req_pool_idx
