"""Structured outputs: a request's JSON schema, regex or EBNF grammar as an xgrammar matcher.

The matcher is built when the request arrives (the compiled grammar is cached by its source, so
a schema compiles once), fills the token mask sampling applies to the request's logits row
(`shoal.engine.sampler`), and accepts each token once the step's results are processed, so it
always holds the state after exactly `output_ids`: a retracted request keeps it, and a stale
token (dropped by `Scheduler.process_results`) never reaches it. A request whose grammar
terminates (its stop token sampled once the grammar is complete) finishes with `stop`.

JSON is generated compact (no free whitespace between tokens): a small model cannot then spend
its tokens on spaces and newlines.
"""

from __future__ import annotations

from collections.abc import Callable

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from shoal.ipc.messages import FinishReason, SamplingParams
from shoal.scheduler.request import Req


class Grammars:
    """Compiles constraints against one tokenizer's token table (built on first use)."""

    def __init__(self, make_tokenizer_info: Callable[[], xgr.TokenizerInfo]) -> None:
        self._make_tokenizer_info = make_tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                      stop_token_ids: set[int]) -> Grammars:
        """`vocab_size`: the width of the model's logits (the tokenizer may have fewer ids)."""
        return cls(lambda: xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)))

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._make_tokenizer_info(), max_threads=1)
        return self._compiler

    def matcher(self, params: SamplingParams) -> xgr.GrammarMatcher | None:
        """The matcher of the request's constraint, None when it has none; raises ValueError
        when the constraint does not compile."""
        try:
            if params.json_schema is not None:
                compiled = self.compiler.compile_json_schema(params.json_schema,
                                                             any_whitespace=False)
            elif params.regex is not None:
                compiled = self.compiler.compile_regex(params.regex)
            elif params.ebnf is not None:
                compiled = self.compiler.compile_grammar(params.ebnf)
            else:
                return None
        except RuntimeError as exc:
            raise ValueError(f"the constraint does not compile: {exc}") from exc
        return xgr.GrammarMatcher(compiled)


def accept(req: Req, token: int) -> FinishReason | None:
    """Advance the request's matcher with its newest token; `stop` once the grammar ends."""
    if req.grammar is None:
        return None
    req.grammar.accept_token(token)
    return FinishReason(kind="stop", matched_token=token) if req.grammar.is_terminated() else None
