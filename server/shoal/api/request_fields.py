"""Which request fields are refused, and what a refusal says (docs/api.md has the tables).

Every field a request may carry is one of three kinds:
- honoured: a field of a request model (`protocol.py`, `responses_protocol.py`) that shoal acts on;
- accepted and ignored: a field of a request model listed in the model's `ignored_fields`
  (metadata such as `user`, which cannot change what is generated);
- refused: anything else. A request naming it gets a 400 whose `param` is the field. The fields
  below are refused with a hint; any other unknown field as "unrecognized", as OpenAI does.

A refused field sent with a value that asks for nothing (null, or its `no_ops`: `best_of: 1`,
`use_beam_search: false`, ...) is dropped instead: clients that spell out defaults keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refusal:
    hint: str
    no_ops: tuple[Any, ...] = ()  # values, besides null, that ask for nothing

    def asks_nothing(self, value: Any) -> bool:
        return value is None or any(
            value == no_op and isinstance(value, bool) == isinstance(no_op, bool)
            for no_op in self.no_ops)


_NO_GRAMMAR = "use `response_format` (or `regex` / `ebnf`)"
_CHAT_TEMPLATE = "chat template options are served by /v1/chat/completions"

REFUSED: dict[str, Refusal] = {
    # OpenAI fields shoal does not implement
    "best_of": Refusal("returning the best of several samples is not implemented; use `n`", (1,)),
    "suffix": Refusal("insertion after a suffix is not supported", ("",)),
    "audio": Refusal("audio output is not supported"),
    "modalities": Refusal("only text output is supported", (["text"],)),
    "functions": Refusal("the deprecated functions API is not supported; use `tools`", ([],)),
    "function_call": Refusal("the deprecated functions API is not supported; use `tool_choice`"),
    "reasoning_effort": Refusal("reasoning controls are not supported"),
    "reasoning": Refusal("reasoning controls are not supported", ({},)),
    "verbosity": Refusal("verbosity controls are not supported"),
    "web_search_options": Refusal("built-in web search is not supported"),
    "moderation": Refusal("moderation is not supported"),
    "previous_response_id": Refusal("responses are not stored; send the whole conversation as "
                                    "`input`"),
    "conversation": Refusal("conversations are not stored; send the whole conversation as "
                            "`input`"),
    "background": Refusal("background responses are not supported", (False,)),
    "prompt": Refusal("stored prompt templates (Responses API) are not supported"),
    "include": Refusal("extra output data (`include`) is not supported", ([],)),
    "truncation": Refusal("input truncation is not supported: an input that does not fit is a "
                          "400", ("disabled",)),
    "max_tool_calls": Refusal("limits on built-in tool calls are not supported"),
    "context_management": Refusal("context management is not supported", ([],)),
    "tools": Refusal("tool calling is served by /v1/chat/completions", ([],)),
    "tool_choice": Refusal("tool calling is served by /v1/chat/completions", ("auto", "none")),
    "top_logprobs": Refusal("log-probabilities are served by /v1/chat/completions and "
                            "/v1/completions", (0,)),
    # SGLang / vLLM extensions that change generation and are not implemented
    "stop_regex": Refusal("regular-expression stop conditions are not supported; use `stop`"),
    "no_stop_trim": Refusal("stop strings are always trimmed from the output", (False,)),
    "include_stop_str_in_output": Refusal("stop strings are always trimmed from the output",
                                          (False,)),
    "continue_final_message": Refusal(_CHAT_TEMPLATE, (False,)),
    "add_generation_prompt": Refusal(_CHAT_TEMPLATE, (True,)),
    "chat_template": Refusal("the model's own chat template is always used"),
    "chat_template_kwargs": Refusal(_CHAT_TEMPLATE, ({},)),
    "documents": Refusal("chat template documents are not supported", ([],)),
    "echo": Refusal("echo is served by /v1/completions", (False,)),
    "guided_json": Refusal(_NO_GRAMMAR),
    "guided_regex": Refusal(_NO_GRAMMAR),
    "guided_choice": Refusal(_NO_GRAMMAR),
    "guided_grammar": Refusal(_NO_GRAMMAR),
    "guided_decoding_backend": Refusal(_NO_GRAMMAR),
    "guided_whitespace_pattern": Refusal(_NO_GRAMMAR),
    "structured_outputs": Refusal(_NO_GRAMMAR),
    "structural_tag": Refusal(_NO_GRAMMAR),
    "use_beam_search": Refusal("beam search is not implemented", (False,)),
    "length_penalty": Refusal("beam search is not implemented", (1.0,)),
    "prompt_logprobs": Refusal("use /v1/completions with `echo` and `logprobs`"),
    "allowed_token_ids": Refusal("use `logit_bias`"),
    "bad_words": Refusal("use `logit_bias`", ([],)),
    "truncate_prompt_tokens": Refusal("prompts are never truncated: one that does not fit is a "
                                      "400"),
    "spaces_between_special_tokens": Refusal("special tokens are decoded as the tokenizer does",
                                             (True,)),
    "lora_path": Refusal("LoRA adapters are not supported"),
    "return_hidden_states": Refusal("hidden states are not returned", (False,)),
    "separate_reasoning": Refusal("reasoning parsing is not supported", (False,)),
    "stream_reasoning": Refusal("reasoning parsing is not supported", (False,)),
    "custom_logit_processor": Refusal("custom logit processors are not supported"),
    "custom_params": Refusal("custom logit processors are not supported"),
    "typical_p": Refusal("typical sampling is not implemented; use `top_p` or `min_p`", (1.0,)),
    "sampling_seed": Refusal("use `seed`"),
    "image_data": Refusal("images are not supported"),
    "n": Refusal("`n` is served by the OpenAI routes; send one /generate request per sample",
                 (1,)),
}


def refusal_message(name: str) -> str:
    refusal = REFUSED.get(name)
    if refusal is None:
        return f"Unrecognized request argument supplied: {name}"
    return f"`{name}` is not supported: {refusal.hint}."


def drop_no_ops(data: Any, fields: set[str]) -> Any:
    """`data` without the refused fields (not among `fields`, the model's own) whose values ask
    for nothing; what remains of the refused fields is then rejected as an extra field."""
    if not isinstance(data, dict):
        return data
    return {key: value for key, value in data.items()
            if key in fields or key not in REFUSED or not REFUSED[key].asks_nothing(value)}
