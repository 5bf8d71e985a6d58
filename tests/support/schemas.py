"""Varied JSON schemas for structured-output tests, built from a fixed seed: nested objects,
arrays with min/max items, enums, numbers and integers with ranges, booleans, nullable fields,
required fields and `additionalProperties: false`."""

from __future__ import annotations

import random
from typing import Any

NAMES = ["name", "city", "age", "score", "tags", "active", "owner", "items", "price", "level",
         "color", "id", "notes", "rating", "address", "size"]


def leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "enum", "integer", "number", "boolean", "nullable"])
    if kind == "string":
        return {"type": "string", "minLength": rng.choice([0, 1]),
                "maxLength": rng.choice([8, 16, 24])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"],
                                   rng.randint(2, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}


def node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth > 0 and roll < 0.25:
        return obj(rng, depth - 1)
    if depth > 0 and roll < 0.45:
        low = rng.randint(0, 2)
        return {"type": "array", "items": node(rng, depth - 1), "minItems": low,
                "maxItems": low + rng.randint(1, 3)}
    return leaf(rng)


def obj(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(1, 4))
    schema: dict[str, Any] = {
        "type": "object", "properties": {name: node(rng, depth) for name in names},
        "required": rng.sample(names, rng.randint(1, len(names))),
        "additionalProperties": False}
    return schema


def json_schemas(count: int = 50, seed: int = 14) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [obj(rng, depth=rng.randint(0, 2)) for _ in range(count)]
