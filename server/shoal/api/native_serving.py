"""Native `/generate` (SGLang's): `text` or `input_ids` in, `text`, `output_ids` and `meta_info`
out; streamed chunks carry everything so far (cumulative), as SGLang's do."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from shoal.api.choices import checked_outputs
from shoal.api.errors import bad_request
from shoal.api.logprobs import native_logprobs
from shoal.api.protocol import GenerateRequest
from shoal.api.sse import sse_response
from shoal.api.tokenizer_manager import Accumulated, GenerateResult, TokenizerManager
from shoal.ipc.messages import ReqStrOut, TokenLogprobs

DEFAULT_MAX_NEW_TOKENS = 128


def native_meta(out: ReqStrOut | GenerateResult, started: float) -> dict[str, Any]:
    reason = None
    if (finish := out.finish) is not None:
        matched = finish.matched_str if finish.matched_str is not None else finish.matched_token
        reason = {"type": finish.kind, "matched": matched}
        if finish.kind == "length":
            reason["length"] = out.completion_tokens
        if finish.kind == "abort":
            reason["message"] = finish.message
    return {"id": out.rid, "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
            "finish_reason": reason, "e2e_latency": time.monotonic() - started}


class NativeServing:
    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    async def generate(self, req: GenerateRequest, raw: Request) -> Any:
        tm = self.tm
        tm.check_ready()
        input_ids = self._input_ids(req)
        params = req.sampling_params
        tm.check_token_ids(params.stop_token_ids or [], "stop_token_ids", allow_empty=True)
        tm.check_token_ids(params.logit_bias_ids, "logit_bias", allow_empty=True)
        max_new = tm.max_new_tokens(len(input_ids), params.max_new_tokens,
                                    DEFAULT_MAX_NEW_TOKENS)
        sampling, started = params.to_sampling(max_new, tm.sampling_defaults), time.monotonic()
        tm.check_disaggregation(req.bootstrap(), [sampling])
        if req.stream:
            outputs = tm.generate(input_ids, sampling, rid=req.rid, stream=True,
                                  logprob=req.logprob_params(),
                                  is_disconnected=raw.is_disconnected, bootstrap=req.bootstrap())
            return sse_response(self._stream(req, input_ids, outputs, started))
        result = await tm.generate_full(input_ids, sampling, rid=req.rid,
                                        logprob=req.logprob_params(),
                                        is_disconnected=raw.is_disconnected,
                                        bootstrap=req.bootstrap())
        meta = native_meta(result, started) | self._logprob_meta(
            req, input_ids, result.output_ids, result.logprobs, result.prompt_logprobs)
        return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}

    def _input_ids(self, req: GenerateRequest) -> list[int]:
        if (req.text is None) == (req.input_ids is None):
            raise bad_request("Exactly one of `text` and `input_ids` must be given.")
        input_ids = (self.tm.tokenize(req.text) if req.text is not None
                     else list(req.input_ids or []))
        self.tm.check_token_ids(input_ids, "text" if req.text is not None else "input_ids")
        return input_ids

    async def _stream(self, req: GenerateRequest, input_ids: list[int],
                      outputs: AsyncIterator[ReqStrOut],
                      started: float) -> AsyncIterator[dict[str, Any]]:
        so_far = Accumulated.expecting(logprobs=req.return_logprob)
        async for out in checked_outputs(outputs):
            so_far.add(out)
            meta = native_meta(out, started) | self._logprob_meta(
                req, input_ids, so_far.output_ids, so_far.logprobs, so_far.prompt_logprobs)
            yield {"text": so_far.text, "output_ids": so_far.output_ids, "meta_info": meta}

    def _logprob_meta(self, req: GenerateRequest, input_ids: list[int], output_ids: list[int],
                      logprobs: TokenLogprobs | None,
                      prompt_logprobs: TokenLogprobs | None) -> dict[str, Any]:
        """SGLang's logprob fields of meta_info: `output_token_logprobs` and
        `output_top_logprobs`, and with `logprob_start_len >= 0` the `input_*` ones from that
        prompt position on."""
        meta: dict[str, Any] = {}
        if logprobs is not None:
            meta["output_token_logprobs"], meta["output_top_logprobs"] = native_logprobs(
                self.tm, output_ids, logprobs, req.return_text_in_logprobs)
        if prompt_logprobs is not None:
            start = min(req.logprob_start_len, len(input_ids) - 1)
            meta["input_token_logprobs"], meta["input_top_logprobs"] = native_logprobs(
                self.tm, input_ids[start:], prompt_logprobs, req.return_text_in_logprobs,
                unscored_first=True)
        return meta
