"""Every IPC message survives an encode/decode round trip through the one typed decoder."""

from __future__ import annotations

import msgspec
import pytest

from shoal.ipc.messages import (
    AbortReq,
    BatchStrOut,
    BatchTokenOut,
    ComponentReady,
    FinishReason,
    GenerateReq,
    ReqStrOut,
    ReqTokenOut,
    SamplingParams,
    decode,
    encode,
)

MESSAGES = [
    GenerateReq(rid="r1", input_ids=[1, 2, 3],
                sampling=SamplingParams(max_new_tokens=5, temperature=0.7, seed=3, stop=["\n"]),
                stream=True),
    AbortReq(rid="r1"),
    BatchTokenOut(outputs=[ReqTokenOut(rid="r1", new_ids=[4], finish=None, prompt_tokens=3,
                                       completion_tokens=1, cached_tokens=0,
                                       decode_prefix_ids=[1, 2, 3])]),
    BatchStrOut(outputs=[ReqStrOut(rid="r1", text="é", new_ids=[4],
                                   finish=FinishReason(kind="stop", matched_str="\n"),
                                   prompt_tokens=3, completion_tokens=1, cached_tokens=0)]),
    ComponentReady(component="scheduler", max_total_tokens=10, max_running_requests=2,
                   context_length=8),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert decode(encode(message)) == message  # type: ignore[arg-type]


def test_decoder_rejects_foreign_payloads() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"rid": "x"}))
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode(SamplingParams()))
