"""`/v1/responses` bodies: the OpenAI Responses API request, the response object it returns.

Input is a text or a list of messages (`input_text` parts, or `output_text` parts of an assistant
message sent back as a previous response gave it); `instructions` become a leading system
message. Responses are not stored: `previous_response_id` and `conversation` are refused
(`request_fields.py`), and the response object says `store: false`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from shoal.api.protocol import (
    BootstrapFields,
    OpenAIMetadata,
    StreamOptions,
    StrictModel,
    options_need_stream,
)
from shoal.ipc.messages import SamplingParams
from shoal.tokenizer import OPENAI_DEFAULTS, SamplingDefaults

INPUT_TEXT_TYPES = {"user": "input_text", "system": "input_text", "developer": "input_text",
                    "assistant": "output_text"}
IGNORED_OUTPUT_TEXT_FIELDS = {"annotations", "logprobs"}  # of an output_text part sent back


class InputPart(StrictModel):
    """A part of an input message; anything but text refuses the request in `InputMessage.text`."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class InputMessage(StrictModel):
    ignored_fields = frozenset({"id", "status", "phase"})

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    # accepted and ignored: an output message sent back as a previous response gave it
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        expected = INPUT_TEXT_TYPES[self.role]
        for part in self.content:
            extra = set(part.model_extra or {})
            if expected == "output_text":
                extra -= IGNORED_OUTPUT_TEXT_FIELDS
            if part.type != expected or part.text is None or extra:
                raise ValueError(f"only `{expected}` content parts are supported in "
                                 f"{self.role} messages")
        return "".join(part.text or "" for part in self.content)


class TextFormat(StrictModel):
    type: Literal["text"]


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(BootstrapFields, OpenAIMetadata):
    ignored_fields = OpenAIMetadata.ignored_fields | {"parallel_tool_calls"}

    input: str | list[InputMessage]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = None  # accepted and ignored: tools are refused

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None,
                             info: ValidationInfo) -> StreamOptions | None:
        return options_need_stream(value, info)

    def messages(self) -> list[dict[str, str]]:
        """Chat-template messages: the instructions (as a system message), then the input."""
        messages = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        return messages + [{"role": "system" if m.role == "developer" else m.role,
                            "content": m.text()} for m in self.input]

    def to_sampling(self, max_new_tokens: int, defaults: SamplingDefaults = OPENAI_DEFAULTS
                    ) -> SamplingParams:
        """The request's sampling, `defaults` (the checkpoint's) for the fields it left out."""
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k, min_p=defaults.min_p)


# ---- the response object ----------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens,
                   total_tokens=input_tokens + output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens))


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage] = []
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: str = "auto"
    tools: list[Any] = []
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    store: Literal[False] = False  # responses are never stored
    truncation: Literal["disabled"] = "disabled"
    background: Literal[False] = False
