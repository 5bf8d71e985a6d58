"""The soak's workload and what a correct answer to each of its requests is; pure functions.

`make_requests` draws a seeded mix of chat and completions requests, streaming and not, with
`n` > 1, logprobs, penalties, stop strings and random `max_tokens`; a share of the streaming ones
is cut by the client (a disconnect after a random number of chunks, or `/abort_request` once
their id is known). `check_answer` lists what is wrong with a whole answer, `check_stream` with
a streamed one; a request that was not cut must finish every choice with a `finish_reason`,
and its usage must add up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FINISHED = ("stop", "length")
TOPICS = ["the sea", "a lighthouse", "prime numbers", "a bakery", "the moon", "old maps",
          "a chess game", "rain in the city", "a robot gardener", "volcanoes"]
STOP_STRINGS = [".", "\n", " the", ","]

Cut = Literal["disconnect", "abort"]


@dataclass(frozen=True)
class SoakRequest:
    index: int
    path: str
    body: dict[str, Any]
    cut: Cut | None = None
    cut_after_chunks: int = 0          # chunks read before a disconnect
    prompt_len: int | None = None      # known for token-id prompts

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))

    @property
    def max_tokens(self) -> int:
        return int(self.body["max_tokens"])

    @property
    def id_prefix(self) -> str:
        """What the response id puts before the request id (`/abort_request` takes the rest)."""
        return "chatcmpl-" if self.path == CHAT else "cmpl-"


def make_requests(num_requests: int, seed: int = 0, max_tokens_cap: int = 24,
                  disconnect_fraction: float = 0.2, abort_fraction: float = 0.05
                  ) -> list[SoakRequest]:
    """Half the requests stream; `abort_fraction` of all requests are aborted through
    `/abort_request` (streaming ones with `n` = 1, so that the id names the one request to abort)
    and `disconnect_fraction` of the streaming ones disconnect."""
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        stream = rng.random() < 0.5
        cut: Cut | None = None
        draw = rng.random()
        if stream and draw < 2 * abort_fraction:
            cut = "abort"
        elif stream and draw < 2 * abort_fraction + disconnect_fraction:
            cut = "disconnect"
        requests.append(_request(rng, index, stream, cut, max_tokens_cap))
    return requests


def _request(rng: random.Random, index: int, stream: bool, cut: Cut | None,
             max_tokens_cap: int) -> SoakRequest:
    max_tokens = rng.randint(1, max_tokens_cap)
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream,
                            "n": 1 if cut == "abort" or rng.random() < 0.7 else rng.randint(2, 3)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body |= {"temperature": round(rng.uniform(0.5, 1.2), 2), "seed": rng.randint(0, 10_000)}
    if rng.random() < 0.3:
        body |= {"frequency_penalty": round(rng.uniform(-1, 1), 2),
                 "presence_penalty": round(rng.uniform(-1, 1), 2)}
    if rng.random() < 0.2:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    topic = rng.choice(TOPICS)
    prompt_len = None
    if rng.random() < 0.5:
        path = CHAT
        body["messages"] = [{"role": "user", "content": f"Tell me about {topic}. ({index})"}]
        if rng.random() < 0.25:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 3)}
    else:
        path = COMPLETIONS
        if rng.random() < 0.5:
            body["prompt"] = f"A short story about {topic}, number {index}:"
        else:
            body["prompt"] = [rng.randint(100, 20_000) for _ in range(rng.randint(1, 48))]
            prompt_len = len(body["prompt"])
        if rng.random() < 0.25:
            body["logprobs"] = rng.randint(0, 3)
    cut_after = rng.randint(0, max_tokens) if cut == "disconnect" else 0
    return SoakRequest(index=index, path=path, body=body, cut=cut, cut_after_chunks=cut_after,
                       prompt_len=prompt_len)


def check_usage(req: SoakRequest, usage: dict[str, Any] | None,
                finish_reasons: list[str | None]) -> list[str]:
    """Usage of a finished request: totals add up, the prompt count is the prompt's, no more
    tokens than asked and exactly as many as asked when every choice ran to its length."""
    if usage is None:
        return ["no usage"]
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    problems = []
    if usage["total_tokens"] != prompt + completion:
        problems.append(f"total_tokens {usage['total_tokens']} != {prompt} + {completion}")
    if req.prompt_len is not None and prompt != req.prompt_len:
        problems.append(f"prompt_tokens {prompt}, the prompt has {req.prompt_len}")
    if prompt < 1:
        problems.append(f"prompt_tokens {prompt}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if not 0 <= cached <= prompt:
        problems.append(f"cached_tokens {cached} outside [0, {prompt}]")
    most = req.n * req.max_tokens
    if all(reason == "length" for reason in finish_reasons) and completion != most:
        problems.append(f"completion_tokens {completion}, every choice hit max_tokens: {most}")
    if not 0 < completion <= most:
        problems.append(f"completion_tokens {completion} outside [1, {most}]")
    return problems


def check_finish(req: SoakRequest, finish_reasons: list[str | None]) -> list[str]:
    if len(finish_reasons) != req.n:
        return [f"{len(finish_reasons)} choices, asked for {req.n}"]
    return [f"choice {i} finish_reason {reason!r}" for i, reason in enumerate(finish_reasons)
            if reason not in FINISHED]


def check_answer(req: SoakRequest, answer: dict[str, Any]) -> list[str]:
    """What is wrong with the whole (non-streamed) answer to a request that was not cut."""
    choices = sorted(answer.get("choices", []), key=lambda choice: choice["index"])
    reasons = [choice.get("finish_reason") for choice in choices]
    problems = check_finish(req, reasons) + check_usage(req, answer.get("usage"), reasons)
    for choice, reason in zip(choices, reasons, strict=True):
        count = _logprob_count(req, choice.get("logprobs"))
        if reason == "length" and count is not None and count != req.max_tokens:
            problems.append(f"choice {choice['index']}: {count} logprobs for "
                            f"{req.max_tokens} tokens")
    return problems


def _logprob_count(req: SoakRequest, logprobs: dict[str, Any] | None) -> int | None:
    if logprobs is None:
        return None
    return len(logprobs["content"] if req.path == CHAT else logprobs["tokens"])


@dataclass
class StreamSummary:
    """A streamed answer read as far as the client read it."""

    num_chunks: int = 0
    finish_reasons: dict[int, str | None] | None = None
    usage: dict[str, Any] | None = None
    errors: list[str] | None = None
    done: bool = False
    request_id: str | None = None

    def add(self, event: dict[str, Any]) -> None:
        self.num_chunks += 1
        if "error" in event:
            self.errors = (self.errors or []) + [str(event["error"].get("message"))]
            return
        self.request_id = self.request_id or event.get("id")
        reasons = self.finish_reasons = self.finish_reasons or {}
        for choice in event.get("choices", []):
            reasons.setdefault(choice["index"], None)
            if choice.get("finish_reason") is not None:
                if reasons[choice["index"]] is not None:
                    self.errors = (self.errors or []) + [f"choice {choice['index']} finished twice"]
                reasons[choice["index"]] = choice["finish_reason"]
        self.usage = event.get("usage") or self.usage


def check_stream(req: SoakRequest, summary: StreamSummary) -> list[str]:
    """What is wrong with a streamed answer that was read to its end."""
    problems = list(summary.errors or [])
    if not summary.done:
        problems.append("no [DONE]")
    reasons = [reason for _, reason in sorted((summary.finish_reasons or {}).items())]
    return problems + check_finish(req, reasons) + check_usage(req, summary.usage, reasons)
