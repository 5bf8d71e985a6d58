"""`/v1/embeddings` bodies (OpenAI's): input as a string, strings, token ids or lists of them."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from shoal.api.protocol import StrictModel

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(StrictModel):
    ignored_fields: ClassVar[frozenset[str]] = frozenset({"user"})

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    # shoal's (and vLLM's) extension: cut each input to its first N tokens instead of refusing
    # an input longer than the model takes
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
