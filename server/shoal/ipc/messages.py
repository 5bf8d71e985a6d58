"""Every message that crosses a process boundary, as tagged msgspec structs.

Structs are `array_like` (fields encode positionally): append new fields at the end only.
Decoders are typed: `decode` accepts exactly the union of the socket messages (`decode_many`, a
list of them: rank 0's broadcast), and `decode_sampling_result` the one payload the ranks share
after sampling, so nothing but these structs ever crosses a socket or a collective
(docs/contracts.md, "Wire format").
"""

from __future__ import annotations

from typing import Literal

import msgspec

SEED_BOUND = 2**63  # a seed is an int64: -SEED_BOUND <= seed < SEED_BOUND


class SamplingParams(msgspec.Struct, array_like=True, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Logit processing before sampling (shoal.engine.penalties), in this order: repetition over
    # prompt + output, then frequency and presence over the output (OpenAI), then the min-tokens
    # mask on stop tokens, then logit_bias (token id -> value added).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] = {}
    # Structured outputs (shoal.scheduler.grammar), at most one: each sampled token must keep
    # the output a prefix of a match of this JSON schema (its JSON text), regex or EBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Speculative decoding, when the server runs it: False opts this request out.
    speculative: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def is_constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before sampling (else greedy is a plain argmax)."""
        return bool(self.frequency_penalty or self.presence_penalty
                    or self.repetition_penalty != 1.0 or self.min_new_tokens > 0
                    or self.logit_bias)


class LogprobParams(msgspec.Struct, array_like=True, kw_only=True):
    """Which log-probabilities a request wants: each output token's, with its `top_logprobs_num`
    most likely alternatives, and, when `logprob_start_len >= 0`, those of the prompt tokens from
    that position on (the first of them has none)."""

    top_logprobs_num: int = 0
    logprob_start_len: int = -1


class TokenLogprobs(msgspec.Struct, array_like=True, kw_only=True):
    """Log-probabilities of consecutive tokens: `log_softmax` of the raw model logits (before
    temperature, penalties and logit_bias), each token's own and its most likely alternatives
    (`top_ids`/`top_logprobs` hold one list per token, or nothing when none were asked)."""

    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    def extend(self, other: TokenLogprobs) -> None:
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def slice(self, start: int, end: int | None = None) -> TokenLogprobs:
        return TokenLogprobs(logprobs=self.logprobs[start:end], top_ids=self.top_ids[start:end],
                             top_logprobs=self.top_logprobs[start:end])


class FinishReason(msgspec.Struct, array_like=True, kw_only=True):
    """Why a request ended: `stop` (EOS, stop token or stop string), `length` or `abort`.
    `refused`: the scheduler would not run the request as given (an `abort` that is the request's
    fault, which the api answers with a 400, not a 500)."""

    kind: Literal["stop", "length", "abort"]
    matched_token: int | None = None
    matched_str: str | None = None
    message: str = ""
    # occurrences of matched_str in the output before the one that stopped it (min_new_tokens
    # lets a stop string through early); the text is cut at the next one
    num_earlier_matches: int = 0
    refused: bool = False


class BootstrapInfo(msgspec.Struct, array_like=True, kw_only=True):
    """Where a prefill/decode pair meets for one request (the router adds it to both bodies):
    the prefill server's host and bootstrap port, and a room number naming the request's KV
    transfer (docs/pd.md)."""

    host: str
    port: int
    room: int  # 0 <= room < 2**63


class Message(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """Base of every message; the tag is the class name."""


class GenerateReq(Message):
    """api → scheduler rank 0: a tokenized request."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    logprob: LogprobParams | None = None  # None: no log-probabilities
    bootstrap: BootstrapInfo | None = None  # prefill/decode servers: the pair's meeting point


class AbortReq(Message):
    """api → scheduler rank 0: drop a request wherever it is (queued or running)."""

    rid: str


class ReqTokenOut(msgspec.Struct, array_like=True, kw_only=True):
    """New output ids of one request since its previous `ReqTokenOut`.

    `decode_prefix_ids` and `stop` are sent once, with the first output: the last few prompt ids,
    which the detokenizer decodes as context so that the first token's leading space survives, and
    the request's stop strings, whose possible beginnings the detokenizer holds back.
    """

    rid: str
    new_ids: list[int]
    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    skip_special_tokens: bool = True
    decode_prefix_ids: list[int] = []
    stop: list[str] = []
    logprobs: TokenLogprobs | None = None         # of new_ids, when the request asked
    prompt_logprobs: TokenLogprobs | None = None  # once, with the first output


class BatchTokenOut(Message):
    """scheduler rank 0 → detokenizer."""

    outputs: list[ReqTokenOut]


class ReqStrOut(msgspec.Struct, array_like=True, kw_only=True):
    """Incremental text of one request; `text` never repeats what an earlier chunk carried."""

    rid: str
    text: str
    new_ids: list[int]
    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


class BatchStrOut(Message):
    """detokenizer → api."""

    outputs: list[ReqStrOut]


class ComponentReady(Message):
    """scheduler rank 0 or detokenizer → api, once, when the component can take work."""

    component: str
    max_total_tokens: int = 0
    max_running_requests: int = 0
    context_length: int = 0
    embedding_dimensions: int = 0  # a scheduler serving an embedding model: its vectors' size


class EmbedReq(Message):
    """api → scheduler rank 0: one input of an embedding request, tokenized."""

    rid: str
    input_ids: list[int]


class ReqEmbeddingOut(msgspec.Struct, array_like=True, kw_only=True):
    """One input's vector: little-endian float32 bytes (OpenAI's base64 payload, decoded), or
    nothing and an `error` saying why the input was refused."""

    rid: str
    embedding: bytes
    prompt_tokens: int
    error: str = ""


class BatchEmbeddingOut(Message):
    """scheduler rank 0 → api: the vectors of one forward."""

    outputs: list[ReqEmbeddingOut]


class FlushCacheReq(Message):
    """api → scheduler: drop the prefix cache; refused while requests are queued or running."""

    rid: str


class SchedulerInfoReq(Message):
    """api → scheduler: the KV pool's and the queues' current numbers."""

    rid: str


class ControlReply(Message):
    """scheduler rank 0 → api: the answer to a control request with the same rid."""

    rid: str
    ok: bool
    message: str = ""
    info: dict[str, int] = {}


AnyMessage = (GenerateReq | AbortReq | BatchTokenOut | BatchStrOut | ComponentReady
              | FlushCacheReq | SchedulerInfoReq | ControlReply | EmbedReq | BatchEmbeddingOut)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)
_list_decoder = msgspec.msgpack.Decoder(list[AnyMessage])


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> AnyMessage:
    return _decoder.decode(data)


def encode_many(messages: list[AnyMessage]) -> bytes:
    return _encoder.encode(messages)


def decode_many(data: bytes) -> list[AnyMessage]:
    return _list_decoder.decode(data)


class SamplingResult(msgspec.Struct, array_like=True, kw_only=True):
    """One step's sampling, from the sampling rank to the others: a token per sampled request,
    its log-probabilities (None unless asked), and those of each prompt slice scored this step."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: list[TokenLogprobs] = []


_result_decoder = msgspec.msgpack.Decoder(SamplingResult)


def encode_sampling_result(result: SamplingResult) -> bytes:
    return _encoder.encode(result)


def decode_sampling_result(data: bytes) -> SamplingResult:
    return _result_decoder.decode(data)
