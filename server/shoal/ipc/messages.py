"""Every message that crosses a process boundary, as tagged msgspec structs.

Structs are `array_like` (fields encode positionally): append new fields at the end only.
One typed decoder (`decode`) accepts exactly the union of message types, so nothing but these
structs ever crosses a socket or a collective.
"""

from __future__ import annotations

from typing import Literal

import msgspec


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class FinishReason(msgspec.Struct, array_like=True, kw_only=True):
    """Why a request ended: `stop` (EOS, stop token or stop string), `length` or `abort`."""

    kind: Literal["stop", "length", "abort"]
    matched_token: int | None = None
    matched_str: str | None = None
    message: str = ""


class Message(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """Base of every message; the tag is the class name."""


class GenerateReq(Message):
    """api → scheduler rank 0: a tokenized request."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False


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


class BatchStrOut(Message):
    """detokenizer → api."""

    outputs: list[ReqStrOut]


class ComponentReady(Message):
    """scheduler rank 0 or detokenizer → api, once, when the component can take work."""

    component: str
    max_total_tokens: int = 0
    max_running_requests: int = 0
    context_length: int = 0


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
              | FlushCacheReq | SchedulerInfoReq | ControlReply)

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
