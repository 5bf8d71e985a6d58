"""The decode server's role (`--disaggregation-mode decode`): take each request's prompt KV from
the prefill server the router paired it with, then decode it like any running request.

    prealloc      accepted; learns the prefill's layout, then — first come, first served, while
                  the pool and the request rows allow — gets a slot for every prompt token
                  (`ReqMemory.prealloc`) and asks the prefill for the KV (KVDest)
    transferring  chunks are written into its slots as they arrive (on the scheduler thread, so
                  nothing lands after an abort); when all are in, the prefill's first token is
                  appended (with its logprobs, the prompt's, the cache hit and the sampler's
                  generator) and the request joins `running`: its next step is a decode

A failed transfer frees the slots without caching them (`ReqMemory.abandon`) and aborts the
request with the reason. A request retracted later is recomputed here from the prefix cache,
as on any server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.disaggregation.decode import DecodeTransfer
from shoal.disaggregation.ranks import KVPoll, agree
from shoal.ipc.messages import BootstrapInfo, FinishReason
from shoal.models.parallel import ParallelGroup
from shoal.scheduler.admission import future_slots
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.request import Req
from shoal.scheduler.roles import SchedulerState, StepBatch
from shoal.scheduler.stop import StopChecker


@dataclass
class _Transfer:
    req: Req
    room: int
    address: str


class DecodeRole:
    def __init__(self, transfer: DecodeTransfer, memory: ReqMemory, stop_checker: StopChecker,
                 max_running_requests: int, ranks: ParallelGroup,
                 record_event: Callable[[str], None] | None = None) -> None:
        self.transfer = transfer
        self.memory = memory
        self.stop_checker = stop_checker
        self.max_running_requests = max_running_requests
        self.ranks = ranks
        self.record_event = record_event
        self.prealloc: list[_Transfer] = []
        self.transferring: list[_Transfer] = []

    @property
    def has_work(self) -> bool:
        return bool(self.prealloc or self.transferring)

    def accept(self, req: Req, bootstrap: BootstrapInfo | None) -> bool:
        if bootstrap is None:
            return False
        address = f"{bootstrap.host}:{bootstrap.port}"
        self.transfer.open(bootstrap.room, address, len(req.input_ids))
        self.prealloc.append(_Transfer(req, bootstrap.room, address))
        return True

    def abort(self, rid: str) -> list[Req]:
        dropped = []
        for queue in (self.prealloc, self.transferring):
            for transfer in [t for t in queue if t.req.rid == rid]:
                queue.remove(transfer)
                dropped.append(self._end(transfer, "the request was aborted"))
        return dropped

    def before_schedule(self, state: SchedulerState) -> list[Req]:
        transfers = self.transferring + self.prealloc
        if not transfers:
            return []
        polled = self.transfer.poll([t.room for t in transfers])
        for transfer in self.transferring:  # after the poll: a SUCCESS has all its chunks
            self.transfer.write_chunks(transfer.room, self._slots(transfer.req))
        states = iter(agree(polled, self.ranks))
        done = []
        transferring, self.transferring = self.transferring, []
        for transfer, polled_state in zip(transferring, states):
            if polled_state == KVPoll.SUCCESS:
                done.append(self._commit(transfer, state))
            elif polled_state == KVPoll.FAILED:
                done.append(self._end(transfer, self.transfer.failure(transfer.room)))
            else:
                self.transferring.append(transfer)
        prealloc, self.prealloc = self.prealloc, []
        blocked = False
        for transfer, polled_state in zip(prealloc, states):
            if polled_state == KVPoll.FAILED:
                done.append(self._end(transfer, self.transfer.failure(transfer.room)))
            elif polled_state == KVPoll.WAITING and not blocked and self._fits(transfer.req,
                                                                                state):
                self.memory.prealloc(transfer.req)
                self.transfer.send_dest(transfer.room)
                self.transferring.append(transfer)
                self._record(f"pd-prealloc {transfer.req.rid}")
            else:
                blocked |= polled_state == KVPoll.WAITING  # first come, first served
                self.prealloc.append(transfer)
        return done

    def after_step(self, batch: StepBatch, appended: list[Req]) -> set[str]:
        return set()

    def wait(self, timeout_s: float) -> None:
        self.transfer.wait(timeout_s)

    def info(self) -> dict[str, int]:
        return {"num_prealloc_reqs": len(self.prealloc),
                "num_transferring_reqs": len(self.transferring),
                **self.transfer.counters.as_dict()}

    def _fits(self, req: Req, state: SchedulerState) -> bool:
        """A request row is free and the pool holds its prompt plus its expected output, beyond
        what running and transferring requests are expected to take (as admission counts)."""
        holding = len(state.running) + len(self.transferring)
        if holding >= self.max_running_requests or self.memory.num_free_req_pool_indices == 0:
            return False
        ratio = state.new_token_ratio.value
        reserved = sum(future_slots(r, ratio) for r in state.running) + sum(
            future_slots(t.req, ratio) for t in self.transferring)
        need = future_slots(req, ratio, computed_len=0)
        return need <= self.memory.num_available_slots - reserved

    def _slots(self, req: Req) -> torch.Tensor:
        assert req.req_pool_idx is not None
        return self.memory.req_to_token.table[req.req_pool_idx, :len(req.input_ids)]

    def _commit(self, transfer: _Transfer, state: SchedulerState) -> Req:
        """Every prompt token's KV is in: continue from the prefill's first token."""
        req, first = transfer.req, self.transfer.first_token(transfer.room)
        self.transfer.close(transfer.room)
        req.prefix_hit_len = first.cached_tokens
        req.append_token(first.token)
        if first.logprobs is not None and req.output_logprobs is not None:
            req.output_logprobs.extend(first.logprobs)
        if first.prompt_logprobs is not None and req.prompt_logprobs is not None:
            req.prompt_logprobs = first.prompt_logprobs
        if first.generator_state is not None and req.generator is not None:
            req.generator.set_state(torch.frombuffer(bytearray(first.generator_state),
                                                     dtype=torch.uint8))
        req.finish = self.stop_checker.check(req)
        if req.finish is None:
            state.running.append(req)
        else:
            self.memory.release(req)
        self._record(f"pd-commit {req.rid}")
        return req

    def _end(self, transfer: _Transfer, reason: str) -> Req:
        """The transfer is over unfinished: end it on both sides, free what it held uncached,
        abort the request."""
        self.transfer.abort(transfer.room, reason)
        self.transfer.close(transfer.room)
        self.memory.abandon(transfer.req)
        transfer.req.finish = FinishReason(kind="abort", message=reason)
        self._record(f"pd-abort {transfer.req.rid}")
        return transfer.req

    def _record(self, event: str) -> None:
        if self.record_event is not None:
            self.record_event(event)
