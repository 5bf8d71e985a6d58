"""OpenAI tool calling on /v1/chat/completions: how tools reach the prompt, what decoding is
constrained to, and how output becomes `message.tool_calls`.

Tools go through the model's chat template when it renders them (its source names `tools`);
otherwise `fallback_prompt` adds them to the system message. With `tool_choice: "required"` or a
named function, decoding is constrained (`call_schema`) to a JSON array of calls
`[{"name": ..., "arguments": {...}}]` (one call unless `parallel_tool_calls`), so the calls
always parse. With `auto`, the output is parsed as such an array, or as `<tool_call>{...}
</tool_call>` blocks (the Hermes/Qwen format chat templates ask for); anything else is content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from shoal.api.constraints import DATA_KEYWORDS

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def fallback_prompt(functions: list[dict[str, Any]]) -> str:
    """The system text that describes the tools to a model whose template has no place for
    them."""
    listed = "\n".join(json.dumps(f) for f in functions)
    return ("You can call these functions:\n<tools>\n" + listed + "\n</tools>\n"
            "To call functions, answer with only a JSON array of calls: "
            '[{"name": <function name>, "arguments": <arguments object>}]')


def with_fallback_prompt(messages: list[dict[str, Any]],
                         functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tool description in a leading system message (added to the first
    message when that is the system message)."""
    prompt = fallback_prompt(functions)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def call_schema(functions: list[dict[str, Any]], parallel: bool) -> str:
    """The JSON schema of the calls the output may make: one or more (one unless `parallel`)
    calls of the given functions, each with arguments valid against its `parameters`.

    Each function's `parameters` moves under the root's `$defs` (`_arguments_def`), with its
    local references rebased there, so that its `$defs`/`definitions`, `$ref`s and recursion keep
    their meaning inside the calls' schema."""
    defs = {_arguments_def(i): _rebased(f.get("parameters") or {"type": "object"},
                                        f"#/$defs/{_arguments_def(i)}")
            for i, f in enumerate(functions)}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"enum": [f["name"]]},
                             "arguments": {"$ref": f"#/$defs/{_arguments_def(i)}"}}}
             for i, f in enumerate(functions)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def _arguments_def(index: int) -> str:
    return f"shoal_tool_{index}_arguments"


# keywords whose values map names (of properties, definitions) to schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                            "dependentSchemas"})


def _rebased(schema: Any, root: str) -> Any:
    """A copy of `schema` whose local references (`#`, `#/...`) point at the same places once the
    schema itself sits at JSON pointer `root`."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, root)
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(the content left, the calls) of an output; no calls when it makes none of `names`."""
    stripped = text.strip()
    calls = _calls_of(_json_or_none(stripped), names)
    if calls:
        return None, calls
    blocks = TOOL_CALL_BLOCK.findall(text)
    calls = [c for block in blocks for c in _calls_of(_json_or_none(block), names)]
    if not blocks or len(calls) != len(blocks):
        return text, []
    content = TOOL_CALL_BLOCK.sub("", text).strip()
    return content or None, calls


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls_of(value: Any, names: set[str]) -> list[dict[str, Any]]:
    """OpenAI tool calls from a decoded call or list of calls; [] unless all are valid."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return []
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": item["name"], "arguments": json.dumps(arguments)}})
    return calls
