"""The prefill server's role (`--disaggregation-mode prefill`): compute each request's prompt
and first token, and ship the prompt's KV to the decode server the router paired it with.

    bootstrapping  accepted; waits until its decode holds slots for the prompt (KVDest), so the
                   decode's memory gates the prefill's compute (max_new_tokens is forced to 1)
    computing      in the scheduler's `waiting`/`running` like any request; after each step the
                   KV of what it computed goes out (`after_step`: gathered before the step's
                   releases, so the pool is freed as usual — into the prefix cache)
    inflight       the first token went out with the last chunk (KVDone); its output is held
                   until the decode acknowledges, then the prefill's response ends

A failed transfer (the decode aborted, refused or went away; a timeout) aborts the request here
too. Every rank sends each decode rank the part of its KV that rank takes from it
(`shoal.disaggregation.kv_map`); the ranks agree on each transfer's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from shoal.disaggregation.messages import FirstToken
from shoal.disaggregation.prefill import PrefillTransfer, gather
from shoal.disaggregation.ranks import KVPoll, agree
from shoal.engine.kv_pool import KVPool
from shoal.ipc.messages import BootstrapInfo, FinishReason
from shoal.models.parallel import ParallelGroup
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.request import Req
from shoal.scheduler.roles import SchedulerState, StepBatch


@dataclass
class _Transfer:
    req: Req
    room: int
    sent_len: int = 0  # prompt tokens whose KV went out


def first_token_of(req: Req) -> FirstToken:
    """What the decode needs beyond the KV to continue exactly as this server would."""
    logprobs = req.output_logprobs.slice(0, 1) if req.output_logprobs is not None else None
    state = req.generator.get_state().numpy().tobytes() if req.generator is not None else None
    return FirstToken(token=req.output_ids[0], logprobs=logprobs,
                      prompt_logprobs=req.prompt_logprobs, cached_tokens=req.prefix_hit_len,
                      generator_state=state)


class PrefillRole:
    def __init__(self, transfer: PrefillTransfer, pool: KVPool, memory: ReqMemory,
                 ranks: ParallelGroup,
                 record_event: Callable[[str], None] | None = None) -> None:
        self.transfer = transfer
        self.pool = pool
        self.memory = memory
        self.ranks = ranks
        self.record_event = record_event
        self.bootstrapping: list[_Transfer] = []
        self.computing: dict[str, _Transfer] = {}
        self.inflight: list[_Transfer] = []

    @property
    def has_work(self) -> bool:
        return bool(self.bootstrapping or self.inflight)

    def accept(self, req: Req, bootstrap: BootstrapInfo | None) -> bool:
        if bootstrap is None:
            return False
        req.sampling = msgspec.structs.replace(req.sampling, max_new_tokens=1)
        self.transfer.open(bootstrap.room)
        self.bootstrapping.append(_Transfer(req, bootstrap.room))
        return True

    def abort(self, rid: str) -> list[Req]:
        dropped = []
        for queue in (self.bootstrapping, self.inflight):
            for transfer in [t for t in queue if t.req.rid == rid]:
                queue.remove(transfer)
                dropped.append(self._end(transfer, "the request was aborted"))
        computing = self.computing.pop(rid, None)
        if computing is not None:  # in `waiting`/`running`: the scheduler aborts it
            self._stop(computing, "the request was aborted")
        return dropped

    def before_schedule(self, state: SchedulerState) -> list[Req]:
        computing = list(self.computing.values())
        transfers = computing + self.bootstrapping + self.inflight
        if not transfers:
            return []
        states = iter(agree(self.transfer.poll([t.room for t in transfers]), self.ranks))
        done = []
        for transfer, polled in zip(computing, states):
            if polled == KVPoll.FAILED:
                del self.computing[transfer.req.rid]
                req = self._end(transfer, self.transfer.failure(transfer.room))
                if req in state.waiting:  # in `running`, `_finish_aborted` outputs it
                    state.waiting.remove(req)
                    done.append(req)
        bootstrapping, self.bootstrapping = self.bootstrapping, []
        for transfer, polled in zip(bootstrapping, states):
            if polled == KVPoll.FAILED:
                done.append(self._end(transfer, self.transfer.failure(transfer.room)))
            elif polled >= KVPoll.WAITING:
                self.computing[transfer.req.rid] = transfer
                state.waiting.append(transfer.req)
                self._record(f"pd-compute {transfer.req.rid}")
            else:
                self.bootstrapping.append(transfer)
        inflight, self.inflight = self.inflight, []
        for transfer, polled in zip(inflight, states):
            if polled == KVPoll.SUCCESS:
                self.transfer.close(transfer.room)
                done.append(transfer.req)
                self._record(f"pd-done {transfer.req.rid}")
            elif polled == KVPoll.FAILED:
                done.append(self._end(transfer, self.transfer.failure(transfer.room)))
            else:
                self.inflight.append(transfer)
        return done

    def after_step(self, batch: StepBatch, appended: list[Req]) -> set[str]:
        if not self.computing:
            return set()
        for (req, _), epoch, end in zip(batch.entries, batch.epochs, batch.forward.seq_lens_list):
            transfer = self.computing.get(req.rid)
            if transfer is not None and transfer.req is req and req.epoch == epoch:
                self._send(transfer, min(end, len(req.input_ids)))
        held = set()
        for req in appended:
            transfer = self.computing.pop(req.rid, None)
            if transfer is None:
                continue
            assert transfer.sent_len == len(req.input_ids), "the last chunk went out first"
            self.transfer.send_done(transfer.room, len(req.input_ids), first_token_of(req))
            self.inflight.append(transfer)
            held.add(req.rid)
        return held

    def wait(self, timeout_s: float) -> None:
        self.transfer.wait(timeout_s)

    def info(self) -> dict[str, int]:
        return {"num_bootstrap_reqs": len(self.bootstrapping),
                "num_transferring_reqs": len(self.computing) + len(self.inflight),
                **self.transfer.counters.as_dict()}

    def _send(self, transfer: _Transfer, end: int) -> None:
        """KV of the prompt tokens computed so far and not sent yet (a cached prefix included)."""
        start, req = transfer.sent_len, transfer.req
        if end <= start or req.req_pool_idx is None:
            return
        if self.transfer.sends_kv(transfer.room):
            slots = self.memory.req_to_token.table[req.req_pool_idx, start:end]
            k, v = gather(self.pool, slots)
            self.transfer.send_chunk(transfer.room, start, k, v)
        transfer.sent_len = end

    def _stop(self, transfer: _Transfer, reason: str) -> None:
        """The transfer is over unfinished: end it on both sides."""
        self.transfer.abort(transfer.room, reason)
        self.transfer.close(transfer.room)
        self._record(f"pd-abort {transfer.req.rid}")

    def _end(self, transfer: _Transfer, reason: str) -> Req:
        """`_stop`, and the request is aborted with the reason."""
        self._stop(transfer, reason)
        transfer.req.finish = FinishReason(kind="abort", message=reason)
        return transfer.req

    def _record(self, event: str) -> None:
        if self.record_event is not None:
            self.record_event(event)
