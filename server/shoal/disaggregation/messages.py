"""The KV channel between a prefill and a decode server, kept apart from the component sockets'
messages (its own struct family and decoders; nothing is pickled).

    bootstrap: a decode rank's DEALER ⇄ the prefill's rank-0 ROUTER (request / reply)
        LayoutQuery → PrefillLayout         each side's layout; where the prefill's ranks listen
        Ping → Pong                          liveness both ways; a new session = a restart
    transfer: PUSH to a peer rank's PULL inbox (every decode rank ⇄ every prefill rank)
        decode → prefill   KVDest            the decode rank holds slots for the room's prompt
                                             and wants this slice of the prefill rank's KV
                           KVAck             every token arrived (or not): the prefill may end
        prefill → decode   KVChunk + 2 raw frames (K, V)   KV of prompt tokens [start, start+n)
                           KVDone            this prefill rank sent everything; from the
                                             sampling rank, the first token
        either way         KVAbort           the room is over on the sender's side

A chunk's frames hold the K and V of the slice its KVDest wanted (`shoal.disaggregation.kv_map`)
as [layers, num_tokens, kv_heads, head_dim] in the layout's dtype, contiguous; the receiver
writes them into the slots it preallocated, at the slice's layers and heads.
"""

from __future__ import annotations

import msgspec

from shoal.ipc.messages import TokenLogprobs


class KVMessage(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """Base of every KV-channel message; the tag is the class name."""


class ServerLayout(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """What one side serves and how its ranks split the KV cache."""

    model: str          # served model name
    fingerprint: str    # of the model's config (shoal.disaggregation.layout.model_fingerprint)
    dtype: str
    num_layers: int
    num_heads: int      # query heads
    num_kv_heads: int
    tp: int
    pp: int


class KVSlice(msgspec.Struct, array_like=True, frozen=True):
    """Layers [layer_start, layer_end) and KV heads [head_start, head_end), in the whole model's
    numbering."""

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int


class LayoutQuery(KVMessage):
    session: str          # the asking decode rank's
    server: ServerLayout  # the decode server's


class PrefillLayout(KVMessage):
    session: str          # the prefill server's (rank 0's); a new one means it restarted
    server: ServerLayout
    endpoints: list[str]  # each global rank's transfer inbox


class Ping(KVMessage):
    session: str  # the pinging decode rank's


class Pong(KVMessage):
    session: str  # the prefill server's


class KVDest(KVMessage):
    room: int
    session: str      # the decode rank's
    endpoint: str     # its inbox
    num_tokens: int   # prompt tokens it holds slots for
    rank: int         # the decode rank's global rank
    num_ranks: int    # the decode server's ranks: each sends the prefill rank a KVDest
    want: KVSlice | None  # what this prefill rank sends it; None: nothing (still acknowledged)


class KVChunk(KVMessage):
    room: int
    session: str      # the destination's, as its KVDest named it
    start: int
    num_tokens: int
    source: int       # the sending prefill rank's global rank


class FirstToken(msgspec.Struct, array_like=True, kw_only=True):
    """What the prefill computed beyond the KV, so the decode's response is whole."""

    token: int
    logprobs: TokenLogprobs | None = None         # of the token, when the request asked
    prompt_logprobs: TokenLogprobs | None = None  # when the request asked
    cached_tokens: int = 0                        # prompt tokens the prefill's cache served
    generator_state: bytes | None = None          # a sampled request's generator, after it


class KVDone(KVMessage):
    room: int
    session: str
    num_tokens: int   # the whole prompt, every chunk sent
    source: int       # the sending prefill rank's global rank
    first: FirstToken | None  # from the prefill's sampling rank (TP 0 of its last stage) only


class KVAck(KVMessage):
    room: int
    rank: int         # the acknowledging decode rank's global rank
    ok: bool
    message: str = ""


class KVAbort(KVMessage):
    room: int
    reason: str


AnyKVMessage = (LayoutQuery | PrefillLayout | Ping | Pong | KVDest | KVChunk | KVDone | KVAck
                | KVAbort)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyKVMessage)


def encode(message: KVMessage) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview) -> AnyKVMessage:
    return _decoder.decode(data)
