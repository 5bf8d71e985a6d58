"""Incremental detokenization: each request's new ids in, only its newly printable text out.

A request's `DecodeState.ids` is a sliding window; nothing before it is needed again:

    ids:  [ context ids ........ | pending ids ....... ]
          0                read_offset           len(ids)
    context = decode(ids[:read_offset])   # already-committed text, decoded again only as context
    new     = decode(ids)[len(context):]  # text of the pending ids

The window starts with the prompt tail (`decode_prefix_ids`), so a tokenizer that drops the leading
space of a sequence's first word (sentencepiece) keeps the first output token's space. `new` is
committed, and the window slides to start at `read_offset`, once it is non-empty and does not end
in U+FFFD (an incomplete UTF-8 character). Committed text is sent, except a tail that is, or could
still grow into, one of the request's stop strings: that tail waits for the next token or the
finish. So no character of a matched stop string is ever sent, and the final trim only has to look
at unsent text.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from shoal.ipc.messages import FinishReason, ReqTokenOut

REPLACEMENT_CHAR = "\ufffd"
DEFAULT_MAX_STATES = 65536


@dataclass(slots=True)
class DecodeState:
    ids: list[int]
    read_offset: int
    skip_special_tokens: bool
    stop: list[str]
    unsent_text: str = ""  # committed but held back: it may be the start of a stop string

    @classmethod
    def first(cls, out: ReqTokenOut) -> DecodeState:
        """The state of a request, from its first output (the only one with context and stops)."""
        prefix = list(out.decode_prefix_ids)
        return cls(ids=prefix, read_offset=len(prefix), skip_special_tokens=out.skip_special_tokens,
                   stop=[stop for stop in out.stop if stop])

    def append(self, out: ReqTokenOut) -> None:
        """Take the new ids, minus a final matched stop token: its text is never emitted."""
        new_ids = out.new_ids
        matched = out.finish.matched_token if out.finish is not None else None
        if matched is not None and new_ids and new_ids[-1] == matched:
            new_ids = new_ids[:-1]
        self.ids.extend(new_ids)

    def advance(self, context_text: str, full_text: str, finish: FinishReason | None) -> str:
        """Given `decode(ids[:read_offset])` and `decode(ids)`, commit what is complete and
        return the text to send now; on the finish, everything left up to a matched stop string."""
        new_text = full_text[len(context_text):]
        if finish is not None:
            return cut_at_stop(self.unsent_text + new_text, finish.matched_str,
                           finish.num_earlier_matches)
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            del self.ids[:self.read_offset]
            self.read_offset = len(self.ids)
            self.unsent_text += new_text
        end = _sendable_end(self.unsent_text, self.stop)
        chunk, self.unsent_text = self.unsent_text[:end], self.unsent_text[end:]
        return chunk


def cut_at_stop(text: str, stop: str | None, skip: int = 0) -> str:
    """`text` up to the stop string's occurrence number `skip` (0: the first). Earlier ones are
    there only when min_new_tokens let them through; all of them are unsent, since sending stops
    at the first occurrence of a stop string."""
    hit = text.find(stop) if stop else -1
    for _ in range(skip):
        if hit < 0:
            break
        hit = text.find(stop, hit + 1)  # type: ignore[arg-type]
    return text if hit < 0 else text[:hit]


def _sendable_end(text: str, stops: list[str]) -> int:
    """Length of the head of `text` that holds no stop string and no tail that could become one."""
    end = len(text)
    for stop in stops:
        hit = text.find(stop)
        if hit >= 0:
            end = min(end, hit)
            continue
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                end = min(end, len(text) - size)
                break
    return end


class IncrementalDetokenizer:
    """Turns batches of `ReqTokenOut` into incremental text, one `DecodeState` per live request.

    A state is created by a request's first output and dropped by its finishing one. At most
    `max_states` are kept (the oldest is evicted), so requests whose finish is lost cannot leak.
    A batch carries at most one output per request.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase,
                 max_states: int = DEFAULT_MAX_STATES) -> None:
        self.tokenizer = tokenizer
        self.max_states = max_states
        self.states: OrderedDict[str, DecodeState] = OrderedDict()

    def detokenize(self, outputs: list[ReqTokenOut]) -> list[str]:
        """The new text of each output, in order."""
        states = [self._state_for(out) for out in outputs]
        for state, out in zip(states, outputs):
            state.append(out)
        texts = self._decode_windows(states)
        chunks = [state.advance(context, full, out.finish)
                  for state, (context, full), out in zip(states, texts, outputs)]
        for out in outputs:
            if out.finish is not None:
                self.states.pop(out.rid, None)
        return chunks

    def _state_for(self, out: ReqTokenOut) -> DecodeState:
        state = self.states.get(out.rid)
        if state is None:
            state = self.states[out.rid] = DecodeState.first(out)
            if len(self.states) > self.max_states:
                self.states.popitem(last=False)
        return state

    def _decode_windows(self, states: list[DecodeState]) -> list[tuple[str, str]]:
        """(context text, full text) of each state's window; one batch decode per special-token
        setting."""
        texts = [("", "")] * len(states)
        for skip in (True, False):
            group = [i for i, state in enumerate(states) if state.skip_special_tokens == skip]
            if not group:
                continue
            windows = [states[i].ids[:states[i].read_offset] for i in group]
            windows += [states[i].ids for i in group]
            decoded = self.tokenizer.batch_decode(windows, skip_special_tokens=skip)
            for j, i in enumerate(group):
                texts[i] = (decoded[j], decoded[len(group) + j])
        return texts
