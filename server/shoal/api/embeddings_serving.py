"""`/v1/embeddings`: tokenize, check each input against the model's limit, embed, encode.

An input longer than the model takes (`max_position_embeddings`, 512 for all-MiniLM-L6-v2) is a
400 unless the request sets `truncate_prompt_tokens`, which keeps each input's first N tokens
(text inputs keep their closing special token). A generation model refuses embedding requests
here; an embedding model refuses generation in the tokenizer manager.
"""

from __future__ import annotations

import base64

import numpy as np

from shoal.api.embeddings_protocol import (
    MAX_INPUTS,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from shoal.api.errors import bad_request
from shoal.api.tokenizer_manager import TokenizerManager


class EmbeddingServing:
    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    async def create(self, req: EmbeddingRequest) -> EmbeddingResponse:
        tm = self.tm
        tm.check_model(req.model)
        tm.check_ready()
        dimensions = tm.embedding_dimensions
        if not dimensions:
            raise bad_request(f"The model `{tm.model_name}` is a generation model: it does not "
                              "compute embeddings. Use /v1/chat/completions or /v1/completions.",
                              "model")
        if req.dimensions is not None and req.dimensions != dimensions:
            raise bad_request(f"This model's embeddings have {dimensions} dimensions; "
                              f"`dimensions` {req.dimensions} cannot change that.", "dimensions")
        inputs = self._tokenize(req)
        outputs = await tm.embeddings.embed(inputs)
        for index, out in enumerate(outputs):
            if out.error:
                raise bad_request(f"Input {index}: {out.error}.", "input")
        num_tokens = sum(len(ids) for ids in inputs)
        if tm.metrics is not None:
            tm.metrics.on_embeddings(len(inputs), num_tokens)
        return EmbeddingResponse(
            data=[Embedding(index=index, embedding=_encode(out.embedding, req.encoding_format))
                  for index, out in enumerate(outputs)],
            model=tm.model_name,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    def _tokenize(self, req: EmbeddingRequest) -> list[list[int]]:
        """Every input's token ids, each within the model's limit."""
        tm = self.tm
        limit = tm.context_length or 0
        keep = req.truncate_prompt_tokens
        if keep is not None and keep > limit:
            raise bad_request(f"`truncate_prompt_tokens` ({keep}) is more than the model takes "
                              f"({limit} tokens).", "truncate_prompt_tokens")
        items = [req.input] if isinstance(req.input, str) else req.input
        if not items:
            raise bad_request("`input` is empty: give a string, a list of strings, or token "
                              "ids.", "input")
        if len(items) > MAX_INPUTS:
            raise bad_request(f"`input` holds {len(items)} items; at most {MAX_INPUTS} per "
                              "request.", "input")
        if isinstance(items[0], int):
            items = [items]  # one input given as token ids
        texts = [(i, item) for i, item in enumerate(items) if isinstance(item, str)]
        for index, text in texts:
            if not text:
                raise bad_request(f"Input {index} is an empty string.", "input")
        encoded = dict(zip(
            (i for i, _ in texts),
            tm.tokenizer([text for _, text in texts], truncation=keep is not None,
                         max_length=keep)["input_ids"] if texts else []))
        inputs: list[list[int]] = []
        for index, item in enumerate(items):
            ids = encoded[index] if isinstance(item, str) else list(item)
            if not isinstance(item, str):
                tm.check_token_ids(ids, "input")
                ids = ids[:keep] if keep is not None else ids
            if len(ids) > limit:
                raise bad_request(
                    f"Input {index} has {len(ids)} tokens; the model takes at most {limit}. "
                    "Shorten it, or set `truncate_prompt_tokens` to keep its first tokens.",
                    "input")
            inputs.append(ids)
        return inputs


def _encode(vector: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    return np.frombuffer(vector, dtype="<f4").tolist()
