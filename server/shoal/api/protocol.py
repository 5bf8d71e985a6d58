"""HTTP request and response bodies: the OpenAI subset shoal serves, and the native `/generate`.

Requests are strict: a string is not an int, and a field is either honoured, accepted and
ignored (listed in the model's `ignored_fields`: metadata that cannot change what is generated),
or refused with a 400 naming it (`request_fields.py`; docs/api.md has the tables). Each request
turns into `shoal.ipc.messages.SamplingParams` through `to_sampling`, once the tokenizer manager
has resolved how many new tokens fit (`max_new_tokens`), and into `LogprobParams` (or None)
through `logprob_params`.

Log-probabilities are those of the raw model logits (before temperature, penalties and
logit_bias; see shoal.engine.logprobs).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from shoal.api.constraints import JSON_OBJECT_SCHEMA, check_ebnf, check_json_schema, check_regex
from shoal.api.request_fields import drop_no_ops
from shoal.api.tool_calls import call_schema
from shoal.ipc.messages import SEED_BOUND, BootstrapInfo, LogprobParams, SamplingParams
from shoal.tokenizer import OPENAI_DEFAULTS, SamplingDefaults

MAX_STOP_STRINGS = 4
MAX_N = 8              # choices per OpenAI request (each is its own request in the scheduler)
MAX_PROMPTS = 256      # prompts in one /v1/completions request
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


class StrictModel(BaseModel):
    """A request body, or a part of one: strict types, and no field it does not declare (a field
    sent as null or with a value that asks for nothing is dropped first: `drop_no_ops`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    ignored_fields: ClassVar[frozenset[str]] = frozenset()  # declared, accepted, not acted on

    @model_validator(mode="before")
    @classmethod
    def _drop_no_ops(cls, data: Any) -> Any:
        return drop_no_ops(data, set(cls.model_fields))


class BootstrapFields(StrictModel):
    """Where a prefill/decode pair meets (docs/pd.md): `shoal router` adds these, SGLang's
    names, to the body it sends both servers; all three or none."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, lt=SEED_BOUND)

    @model_validator(mode="after")
    def _all_or_none(self) -> BootstrapFields:
        given = [self.bootstrap_host, self.bootstrap_port, self.bootstrap_room]
        if any(v is not None for v in given) and any(v is None for v in given):
            raise ValueError("bootstrap_host, bootstrap_port and bootstrap_room go together")
        return self

    def bootstrap(self) -> BootstrapInfo | None:
        if self.bootstrap_host is None or self.bootstrap_port is None \
                or self.bootstrap_room is None:
            return None
        return BootstrapInfo(host=self.bootstrap_host, port=self.bootstrap_port,
                             room=self.bootstrap_room)


class _Sampling(StrictModel):
    """Fields shared by every generation request (OpenAI names plus the SGLang extensions)."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-SEED_BOUND, lt=SEED_BOUND)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    speculative: bool = True  # shoal extension: false opts out of speculative decoding
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string, per JSON) -> bias
    regex: str | None = None  # structured outputs (SGLang's names): the output matches it
    ebnf: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return None

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        return None if value is None else check_regex(value)

    @field_validator("ebnf")
    @classmethod
    def _ebnf(cls, value: str | None) -> str | None:
        return None if value is None else check_ebnf(value)

    def constraints(self) -> dict[str, str]:
        """The structured-output constraints asked for, by their SamplingParams names."""
        return {name: value for name, value in (("regex", self.regex), ("ebnf", self.ebnf))
                if value is not None}

    @model_validator(mode="after")
    def _one_constraint(self) -> _Sampling:
        if len(self.constraints()) > 1:
            raise ValueError(f"at most one constraint may be given, got "
                             f"{' and '.join(self.constraints())}")
        return self

    @property
    def requested_min_tokens(self) -> int:
        return 0

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @model_validator(mode="after")
    def _min_not_above_max(self) -> _Sampling:
        most = self.requested_max_tokens
        if most is not None and self.requested_min_tokens > most:
            raise ValueError(f"the minimum number of tokens ({self.requested_min_tokens}) is "
                             f"larger than the maximum ({most})")
        return self

    @property
    def logit_bias_ids(self) -> list[int]:
        return [int(key) for key in self.logit_bias or {}]

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return -1 if value == 0 else value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are supported")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    def to_sampling(self, max_new_tokens: int, defaults: SamplingDefaults = OPENAI_DEFAULTS
                    ) -> SamplingParams:
        """The request's sampling, `defaults` (the checkpoint's) for the fields it left out."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=stops,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            speculative=self.speculative,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            min_new_tokens=min(self.requested_min_tokens, max_new_tokens),
            logit_bias={int(key): bias for key, bias in (self.logit_bias or {}).items()},
            **self.constraints(),
        )


class StreamOptions(StrictModel):
    ignored_fields = frozenset({"include_obfuscation"})

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


def options_need_stream(value: StreamOptions | None,
                        info: ValidationInfo) -> StreamOptions | None:
    """`stream_options` of a request that does not stream is a 400 (as with OpenAI); the
    request declares `stream` before `stream_options`."""
    if value is not None and not info.data.get("stream"):
        raise ValueError("only allowed when `stream` is true")
    return value


class OpenAIMetadata(StrictModel):
    """What OpenAI requests may carry that cannot change what is generated: accepted and
    ignored (docs/api.md)."""

    ignored_fields = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                                "prompt_cache_key", "prompt_cache_retention"})

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is ever stored
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key
    prompt_cache_retention: str | None = None


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: the output is JSON valid against `schema` (always strict;
    `name` and `description` only label it)."""

    model_config = ConfigDict(populate_by_name=True)
    ignored_fields = frozenset({"name", "description", "strict"})

    name: str | None = None  # OpenAI requires it; shoal does not need it
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # decoding is always constrained to the schema

    @field_validator("schema_")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_json_schema(value)
        return value


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("`json_schema` goes with type `json_schema`, and only with it")
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the output must match; None for plain text."""
        if self.json_schema is not None:
            return check_json_schema(self.json_schema.schema_)
        return JSON_OBJECT_SCHEMA if self.type == "json_object" else None


class _OpenAISampling(_Sampling, BootstrapFields, OpenAIMetadata):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)  # vLLM/SGLang extension: stop tokens masked until then
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None,
                             info: ValidationInfo) -> StreamOptions | None:
        return options_need_stream(value, info)

    def constraints(self) -> dict[str, str]:
        schema = self.response_format.schema_text() if self.response_format else None
        return super().constraints() | ({} if schema is None else {"json_schema": schema})

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_min_tokens(self) -> int:
        return self.min_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class ContentPart(StrictModel):
    """A part of a message's content: only `{"type": "text", "text": ...}` is served; any other
    part (an image, audio, ...) refuses the whole request in `text_of`."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


def text_of(content: str | list[ContentPart] | None, text_type: str = "text") -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != text_type or part.text is None or part.model_extra
           for part in content):
        raise ValueError(f"only `{text_type}` content parts are supported")
    return "".join(part.text or "" for part in content)


class CalledFunction(StrictModel):
    name: str
    arguments: str  # JSON text


class ToolCall(StrictModel):
    """A call an assistant message made (sent back in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictModel):
    ignored_fields = frozenset({"name", "refusal", "annotations"})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # of an assistant message
    tool_call_id: str | None = None  # of a tool message: the call it answers
    # accepted and ignored: the chat template has no place for a name; an assistant message
    # sent back as it came has these
    name: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None

    def text(self) -> str:
        return text_of(self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (`developer` is OpenAI's newer `system`)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(StrictModel):
    ignored_fields = frozenset({"strict"})

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # calls are always constrained or checked against `parameters`

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_json_schema(value)
        return value


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


# apply_chat_template's own arguments, which `chat_template_kwargs` may not set
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                 "add_generation_prompt", "continue_final_message", "tokenize",
                                 "padding", "truncation", "max_length", "return_tensors",
                                 "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat template options: the last assistant message continued, not closed
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None  # default: unless continue_final_message
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _calls_compile(cls, value: list[Tool] | None) -> list[Tool] | None:
        """The schema of calls to any of the tools compiles (each one's `parameters` is checked
        on its own first); the one a request constrains to is that or a part of it."""
        if value:
            check_json_schema(call_schema(
                [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in value],
                parallel=True))
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(_TEMPLATE_ARGUMENTS & (value or {}).keys())
        if taken:
            raise ValueError(f"sets {', '.join(taken)}, which the request's own fields control")
        return value

    @model_validator(mode="after")
    def _continues_an_assistant_message(self) -> ChatCompletionRequest:
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise ValueError("`continue_final_message` continues the last message; it cannot go "
                             "with `add_generation_prompt: true`")
        if self.messages[-1].role != "assistant":
            raise ValueError("`continue_final_message` needs the last message to be the "
                             "assistant's")
        return self

    @property
    def template_options(self) -> dict[str, Any]:
        """The arguments of the chat template besides the messages and tools."""
        return {**(self.chat_template_kwargs or {}),
                "add_generation_prompt": (not self.continue_final_message
                                          if self.add_generation_prompt is None
                                          else self.add_generation_prompt),
                "continue_final_message": self.continue_final_message}

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("`tool_choice` needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools or []}:
            raise ValueError(f"`tool_choice` names `{choice.function.name}`, which is not "
                             f"among the tools")
        if self.must_call and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("`response_format` cannot constrain a request whose `tool_choice` "
                             "requires a call")
        return self

    def callable_functions(self) -> list[dict[str, Any]]:
        """The functions the model may call (all tools, the named one, or none)."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return []
        functions = [t.function.model_dump(exclude_none=True, exclude={"strict"})
                     for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            return [f for f in functions if f["name"] == choice.function.name]
        return functions

    @property
    def must_call(self) -> bool:
        """`required` or a named function: decoding is constrained to calls."""
        return bool(self.tools) and (self.tool_choice == "required"
                                     or isinstance(self.tool_choice, NamedToolChoice))

    def constraints(self) -> dict[str, str]:
        if not self.must_call:
            return super().constraints()
        parallel = self.parallel_tool_calls and not isinstance(self.tool_choice, NamedToolChoice)
        return super().constraints() | {"json_schema": call_schema(self.callable_functions(),
                                                                   parallel)}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_params(self) -> LogprobParams | None:
        return LogprobParams(top_logprobs_num=self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_OpenAISampling):
    """One prompt (text or token ids) or a batch of them; choice i of the response is sample
    `i % n` of prompt `i // n`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: one, unless `prompt` is a list of texts or of id lists."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def logprob_params(self) -> LogprobParams | None:
        """`logprobs: k` asks for each token's logprob and its k most likely alternatives; with
        `echo`, the prompt's too."""
        if self.logprobs is None:
            return None
        return LogprobParams(top_logprobs_num=self.logprobs,
                             logprob_start_len=0 if self.echo else -1)

    @field_validator("prompt")
    @classmethod
    def _batch_size(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_PROMPTS and not isinstance(value[0], int):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request are supported")
        return value


class NativeSampling(_Sampling):
    max_new_tokens: int | None = Field(None, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    json_schema: str | None = None  # the JSON text of a schema (SGLang's name)

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, value: str | None) -> str | None:
        return None if value is None else check_json_schema(value)

    def constraints(self) -> dict[str, str]:
        schema = {} if self.json_schema is None else {"json_schema": self.json_schema}
        return super().constraints() | schema

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_new_tokens

    @property
    def requested_min_tokens(self) -> int:
        return self.min_new_tokens

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value


class GenerateRequest(BootstrapFields):
    """Native `/generate`: exactly one of `text` and `input_ids`."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSampling = NativeSampling()
    stream: bool = False
    rid: str | None = Field(None, min_length=1)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int = Field(-1, ge=-1)  # -1: no prompt logprobs
    return_text_in_logprobs: bool = False

    def logprob_params(self) -> LogprobParams | None:
        if not self.return_logprob:
            return None
        return LogprobParams(top_logprobs_num=self.top_logprobs_num,
                             logprob_start_len=self.logprob_start_len)


class AbortRequest(StrictModel):
    rid: str = ""
    abort_all: bool = False


# ---- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy completions shape; with `echo`, the first prompt token has no logprob."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its `index` among the calls

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    """A `text_completion` object; streamed chunks have the same shape (usage on the last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
