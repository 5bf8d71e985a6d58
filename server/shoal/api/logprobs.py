"""Token log-probabilities in the shapes the APIs return them.

`TokenLogprobs` (from the scheduler) holds numbers and token ids; here ids become token texts
(each token decoded on its own). -inf is reported as -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

from typing import Any

from shoal.api.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from shoal.api.tokenizer_manager import TokenizerManager
from shoal.ipc.messages import TokenLogprobs

MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _top_texts(tm: TokenizerManager, lp: TokenLogprobs) -> list[list[str]]:
    flat = tm.token_texts([i for ids in lp.top_ids for i in ids])
    out, at = [], 0
    for ids in lp.top_ids:
        out.append(flat[at:at + len(ids)])
        at += len(ids)
    return out


def chat_logprobs(tm: TokenizerManager, ids: list[int], lp: TokenLogprobs) -> ChatLogprobs:
    """OpenAI chat `logprobs`: `ids[i]` scored by `lp` entry i."""
    texts = tm.token_texts(ids)
    tops = _top_texts(tm, lp) if lp.top_ids else [[] for _ in ids]
    top_values = lp.top_logprobs if lp.top_ids else [[] for _ in ids]
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=text, logprob=_finite(value), bytes=list(text.encode()),
                         top_logprobs=[TopLogprob(token=t, logprob=_finite(v),
                                                  bytes=list(t.encode()))
                                       for t, v in zip(top_text, top_value)])
        for text, value, top_text, top_value in zip(texts, lp.logprobs, tops, top_values)])


def completion_logprobs(tm: TokenizerManager, ids: list[int], lp: TokenLogprobs,
                        text_offset: int = 0, unscored_first: bool = False) -> CompletionLogprobs:
    """Legacy completions `logprobs` of `ids`, the first of which starts at `text_offset` in the
    choice's text. With `unscored_first` (an echoed prompt's first token), `lp` scores ids[1:].
    Each `top_logprobs` entry holds the token itself besides its alternatives (as OpenAI's and
    vLLM's do), so `logprobs: 0` gives the one token."""
    texts = tm.token_texts(ids)
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    top_texts = _top_texts(tm, lp) if lp.top_ids else [[] for _ in lp.logprobs]
    top_values = lp.top_logprobs if lp.top_ids else [[] for _ in lp.logprobs]
    tops: list[dict[str, float] | None] = []
    for text, value, top_text, top_value in zip(texts[1:] if unscored_first else texts,
                                                 lp.logprobs, top_texts, top_values):
        entry = {t: _finite(v) for t, v in zip(top_text, top_value)}
        entry.setdefault(text, _finite(value))
        tops.append(entry)
    lead: list[Any] = [None] if unscored_first else []
    return CompletionLogprobs(text_offset=offsets, tokens=texts,
                              token_logprobs=lead + [_finite(v) for v in lp.logprobs],
                              top_logprobs=lead + tops)


def join(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=first.text_offset + second.text_offset,
                              tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


def native_logprobs(tm: TokenizerManager, ids: list[int], lp: TokenLogprobs, with_text: bool,
                    unscored_first: bool = False) -> tuple[list[list[Any]], list[list[list[Any]]]]:
    """SGLang's `/generate` meta_info shape: [logprob, token_id, text or None] per token, and per
    token a list of such triples for its top alternatives."""
    texts: list[str | None] = list(tm.token_texts(ids)) if with_text else [None] * len(ids)
    values: list[float | None] = ([None] if unscored_first else []) + [
        _finite(v) for v in lp.logprobs]
    tokens = [[value, token, text] for value, token, text in zip(values, ids, texts)]
    tops: list[list[list[Any]]] = [[] for _ in ids]
    if lp.top_ids:
        top_texts = _top_texts(tm, lp) if with_text else [[None] * len(t) for t in lp.top_ids]
        scored = [[[_finite(v), i, t] for v, i, t in zip(values_, ids_, texts_)]
                  for values_, ids_, texts_ in zip(lp.top_logprobs, lp.top_ids, top_texts)]
        tops = ([[]] if unscored_first else []) + scored
    return tokens, tops
