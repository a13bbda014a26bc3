"""request_body.py and schema_limits.py without a server: the raw-bytes shape scan against a plain state
machine on random JSON full of brackets, commas, quotes and backslashes inside strings, split across chunks."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("fastapi")

from paged_hf.serving.openai import request_body  # noqa: E402
from paged_hf.serving.openai.errors import ApiError  # noqa: E402
from paged_hf.serving.openai.protocol import ChatCompletionRequest  # noqa: E402
from paged_hf.serving.openai.request_body import count_items, json_shape, parse_body, parse_json  # noqa: E402
from paged_hf.serving.openai.schema_limits import check_request_schemas, nesting  # noqa: E402
from paged_hf.serving.openai.server_settings import ServerSettings  # noqa: E402

TRICKY = ["a[b{,", 'q\\"[', "\\\\", '\\\\",', "}]x", '\\\\\\"[', "", ","]


def reference_shape(text: str) -> tuple[int, int]:
    """(depth, commas outside strings), one character at a time."""
    depth = deepest = commas = 0
    inside = escaped = False
    for ch in text:
        if inside:
            escaped, inside = (False, inside) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            inside = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
        elif ch == ",":
            commas += 1
    return deepest, commas


def random_value(rng: random.Random, level: int = 0):
    roll = rng.random()
    if level > 6 or roll < 0.3:
        return rng.choice([*TRICKY, 1, None, 2.5, "\\" * rng.randint(0, 5) + '"['])
    if roll < 0.65:
        return [random_value(rng, level + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(TRICKY) + str(i): random_value(rng, level + 1) for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("chunk", [7, 64, request_body.SCAN_CHUNK])
def test_the_shape_scan_agrees_with_a_state_machine(monkeypatch, chunk):
    monkeypatch.setattr(request_body, "SCAN_CHUNK", chunk)
    rng = random.Random(chunk)
    for _ in range(500):
        text = json.dumps(random_value(rng), indent=rng.choice([None, 1]))
        shape = json_shape(text.encode())
        assert (shape.depth, shape.commas) == reference_shape(text), text


def test_bodies_too_deep_or_not_json_are_400s_naming_the_limit():
    with pytest.raises(ApiError, match="nests 1001 levels deep; at most 1000 .*--max-json-depth"):
        parse_json(b"[" * 1001 + b"]" * 1001, 1000)
    with pytest.raises(ApiError, match="not valid JSON"):
        parse_json(b'{"a": ', 1000)
    assert parse_json(b'{"a": "[[[[[["}', 2) == {"a": "[[[[[["}
    with pytest.raises(ApiError, match="--max-json-depth"):  # deeper than the parser reaches: the same 400
        parse_json(b"[" * 5000 + b"]" * 5000, 10_000)


def test_items_are_counted_with_their_content_blocks():
    body = {"messages": [{"role": "user", "content": [{"type": "text"}] * 3},
                         {"role": "user", "content": [{"type": "tool_result", "content": [{}] * 4}]}],
            "tools": [{}, {}], "prompt": [1, 2, 3]}
    assert count_items(body) == 2 + 3 + 1 + 4 + 2  # token ids are one prompt, not items
    assert count_items({"prompt": ["a", "b"]}) == 2
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 11}).encode()
    with pytest.raises(ApiError, match="11 items .*at most 10 .*--max-request-items"):
        parse_body(raw, ChatCompletionRequest, ServerSettings(max_request_items=10), ("messages",))
    assert len(parse_body(raw, ChatCompletionRequest, ServerSettings(max_request_items=11)).messages) == 11


def test_every_schema_of_a_request_is_held_to_the_depth_limit():
    def deep(levels: int) -> dict:
        schema = {"type": "string"}
        for _ in range(levels - 1):
            schema = {"type": "array", "items": schema}
        return schema

    assert nesting(deep(5), 100) == 5 and nesting(deep(500), 10) == 11  # stops once past the limit
    for fields, named in [({"tools": [{"type": "function", "function": {"name": "f", "parameters": deep(65)}}]},
                           "tools[0].function.parameters"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                       "schema": deep(65)}}},
                           "response_format.json_schema.schema"),
                          ({"structured_outputs": {"json": deep(65)}}, "structured_outputs.json")]:
        request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
        with pytest.raises(ApiError, match=f"{named.replace('[', '.').replace(']', '.')} nests more than 64 .*"
                                           "--max-grammar-depth"):
            check_request_schemas(request, 64)
        check_request_schemas(request, 65)
