"""A fake scheduler + detokenizer and an in-thread uvicorn server, to test the api process fast.

`FakeEngine` binds the scheduler's PULL socket, reports both components ready, and answers every
`GenerateReq` with a scripted reply, one token per `BatchStrOut` chunk:
- the tokens of `WORDS`, in order; after `EOS_AFTER` words comes EOS (id 2, no text), unless
  `ignore_eos` is set: then words repeat until `max_new_tokens` (finish `length`);
- a stop string equal to one of the words ends the reply before that word (finish `stop`);
- a stop token id equal to a word's id ends the reply on that token (its text is not sent);
- `seed == ABORT_SEED` makes the engine abort the request after its first token;
  `seed == REFUSE_SEED` makes it refuse the request before any (a `refused` abort).
`cached_tokens` is `prompt_tokens // 2`. Every message received is kept in `received`.
With `logprob` asked, output token k (from 0) has logprob `fake_logprob(k)` and top alternatives
(id 100 + j, `fake_logprob(j)`) for j < top_logprobs_num; prompt token i scored has logprob
`-i / 10`, same alternatives, sent with the first chunk.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import uvicorn
import zmq

from shoal.ipc import sockets
from shoal.ipc.messages import (
    AbortReq,
    AnyMessage,
    BatchStrOut,
    ComponentReady,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    GenerateReq,
    ReqStrOut,
    SchedulerInfoReq,
    TokenLogprobs,
)
from shoal.ports import free_port
from tests.support.wait import wait_until

WORDS = ["Hello", ",", " world", "!", " How"]
WORD_IDS = [100 + i for i in range(len(WORDS))]
EOS_ID = 2
EOS_AFTER = len(WORDS)
ABORT_SEED = 666
REFUSE_SEED = 667


def fake_logprob(k: int) -> float:
    return -0.25 * (k + 1)


def fake_logprobs(values: list[float], top_n: int) -> TokenLogprobs:
    tops = [[100 + j for j in range(top_n)] for _ in values] if top_n else []
    return TokenLogprobs(logprobs=values, top_ids=tops,
                         top_logprobs=[[fake_logprob(j) for j in range(top_n)] for _ in tops])


def script(req: GenerateReq) -> list[ReqStrOut]:
    """The chunks the fake engine sends for `req`; the last one carries `finish`."""
    sampling, chunks = req.sampling, []
    prompt_tokens = len(req.input_ids)
    lp = req.logprob

    def out(text: str, ids: list[int], finish: FinishReason | None = None) -> ReqStrOut:
        logprobs = prompt_logprobs = None
        if lp is not None:
            logprobs = fake_logprobs([fake_logprob(len(chunks))] * len(ids), lp.top_logprobs_num)
            if lp.logprob_start_len >= 0 and not chunks:
                start = min(lp.logprob_start_len, prompt_tokens - 1)
                prompt_logprobs = fake_logprobs([-i / 10 for i in range(start + 1, prompt_tokens)],
                                                lp.top_logprobs_num)
        return ReqStrOut(rid=req.rid, text=text, new_ids=ids, finish=finish,
                         prompt_tokens=prompt_tokens, completion_tokens=len(chunks) + 1,
                         cached_tokens=prompt_tokens // 2, logprobs=logprobs,
                         prompt_logprobs=prompt_logprobs)

    while True:
        step = len(chunks)
        if step == EOS_AFTER and not sampling.ignore_eos:
            chunks.append(out("", [EOS_ID], FinishReason(kind="stop", matched_token=EOS_ID)))
            return chunks
        word, word_id = WORDS[step % len(WORDS)], WORD_IDS[step % len(WORDS)]
        if word in sampling.stop:
            chunks.append(out("", [word_id], FinishReason(kind="stop", matched_str=word)))
            return chunks
        if word_id in sampling.stop_token_ids:
            chunks.append(out("", [word_id], FinishReason(kind="stop", matched_token=word_id)))
            return chunks
        if sampling.seed == REFUSE_SEED:
            chunks.append(out("", [], FinishReason(kind="abort", message="the regex is odd",
                                                   refused=True)))
            return chunks
        if sampling.seed == ABORT_SEED and step == 1:
            chunks.append(out("", [], FinishReason(kind="abort", message="scheduler said no")))
            return chunks
        length = step + 1 == sampling.max_new_tokens
        chunks.append(out(word, [word_id], FinishReason(kind="length") if length else None))
        if length:
            return chunks


@dataclass
class _Running:
    chunks: list[ReqStrOut]
    next_at: float


class FakeEngine:
    def __init__(self, run_dir: str, context_length: int = 256, send_ready: bool = True,
                 token_delay_s: float = 0.005) -> None:
        self.endpoints = sockets.Endpoints(run_dir)
        self.context_length = context_length
        self.send_ready = send_ready
        self.token_delay_s = token_delay_s
        self.received: list[GenerateReq | AbortReq] = []
        self._running: dict[str, _Running] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)

    def start(self) -> FakeEngine:
        self._thread.start()
        assert self._ready.wait(5), "fake engine did not start"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def generate_reqs(self) -> dict[str, GenerateReq]:
        return {m.rid: m for m in list(self.received) if isinstance(m, GenerateReq)}

    def aborted_rids(self) -> set[str]:
        return {m.rid for m in list(self.received) if isinstance(m, AbortReq)}

    def _run(self) -> None:
        ctx = zmq.Context()
        pull = sockets.pull_socket(ctx, self.endpoints.scheduler_input)
        push = sockets.push_socket(ctx, self.endpoints.api_input)
        if self.send_ready:
            sockets.send(push, ComponentReady(component="scheduler",
                                              max_total_tokens=2 * self.context_length,
                                              max_running_requests=8,
                                              context_length=self.context_length))
            sockets.send(push, ComponentReady(component="detokenizer"))
        self._ready.set()
        while not self._stop.is_set():
            if pull.poll(timeout=2):
                for message in sockets.recv_nowait(pull):
                    reply = self._handle(message)
                    if reply is not None:
                        sockets.send(push, reply)
            outputs = self._due_outputs(time.monotonic())
            if outputs:
                sockets.send(push, BatchStrOut(outputs=outputs))
        ctx.destroy(linger=0)

    def _handle(self, message: AnyMessage) -> ControlReply | None:
        self.received.append(message)
        if isinstance(message, GenerateReq):
            self._running[message.rid] = _Running(script(message), time.monotonic())
        elif isinstance(message, AbortReq):
            self._running.pop(message.rid, None)
        elif isinstance(message, FlushCacheReq):
            return ControlReply(rid=message.rid, ok=not self._running, message="busy")
        elif isinstance(message, SchedulerInfoReq):
            return ControlReply(rid=message.rid, ok=True, info={"num_free_slots": 7})
        return None

    def _due_outputs(self, now: float) -> list[ReqStrOut]:
        outputs = []
        for rid, running in list(self._running.items()):
            if running.next_at <= now:
                outputs.append(running.chunks.pop(0))
                running.next_at = now + self.token_delay_s
                if not running.chunks:
                    del self._running[rid]
        return outputs


class ServerThread:
    """Runs an ASGI app under a real uvicorn server on 127.0.0.1 in a background thread."""

    def __init__(self, app: object) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        wait_until(lambda: self.server.started, timeout=10, what="uvicorn starts", interval=0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
