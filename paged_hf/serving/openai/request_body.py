"""Request bodies read in a worker thread and bounded before they become requests.

Why not FastAPI's own body parameter: it parses and validates on the event loop (a 4 MB body holds every
stream and /health for tens of milliseconds), and a body nested deeper than Python's recursion limit makes
`json.loads` raise RecursionError, which every later step (validation, a template's `tojson`, `json.dumps`
of a tool's input) would meet again. So each route reads its body here: its nesting is measured on the raw
bytes (numpy, before anything recurses), then it is parsed, counted and validated in a worker thread. Over a
limit: a 400 naming the flag.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ValidationError

from paged_hf.serving.openai.errors import ApiError, validation_message

_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_OPENERS, _CLOSERS = (ord("["), ord("{")), (ord("]"), ord("}"))

#: Fields whose lists are a request's items: chat messages, Responses input items, tools, system blocks,
#: a completions batch's prompts. Content-block lists inside their items count too.
ITEM_FIELDS = ("messages", "input", "tools", "system", "prompt")


SCAN_CHUNK = 256 << 10  # bytes json_shape scans at once: its arrays stay a few MB whatever the body's size


@dataclass(frozen=True)
class JsonShape:
    depth: int  # how deep arrays and objects nest
    commas: int  # separators outside strings: a JSON value with n items in its arrays and objects has ~n of them


def json_shape(raw: bytes) -> JsonShape:
    """The shape of the JSON text `raw`, without parsing it (brackets and commas inside strings do not count; a
    quote is escaped when an odd run of backslashes precedes it). Vectorized, in chunks: linear in the size
    whatever the text holds, ~15 ms a MB, numpy's loops without the GIL. Why not parse first: `json.loads` of
    a 3 MB body of 1M ids holds the GIL for 0.1 s in one call."""
    data = np.frombuffer(raw, dtype=np.uint8)
    inside, backslashes, depth, deepest, commas = 0, 0, 0, 0, 0  # carried from chunk to chunk
    for start in range(0, data.size, SCAN_CHUNK):
        chunk = data[start:start + SCAN_CHUNK]
        positions = np.arange(chunk.size, dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(chunk != _BACKSLASH, positions, -1))  # last non-backslash
        quotes = np.flatnonzero(chunk == _QUOTE)
        before = last_other[np.maximum(quotes - 1, 0)]
        run = np.where(before >= 0, quotes - 1 - before, quotes + backslashes)  # backslashes just before each
        run[quotes == 0] = backslashes
        toggles = np.zeros(chunk.size, dtype=np.int8)
        toggles[quotes[run % 2 == 0]] = 1
        state = (np.cumsum(toggles, dtype=np.int32) + inside) % 2  # 1: in a string (its opening quote too)
        outside = state == 0
        commas += int(np.count_nonzero((chunk == _COMMA) & outside))
        steps = np.isin(chunk, _OPENERS).astype(np.int8) - np.isin(chunk, _CLOSERS).astype(np.int8)
        levels = np.cumsum(steps * outside, dtype=np.int32) + depth
        deepest = max(deepest, int(levels.max()))
        depth, inside = int(levels[-1]), int(state[-1])
        tail = chunk.size - 1 - int(last_other[-1])
        backslashes = tail + backslashes if last_other[-1] < 0 else tail
    return JsonShape(deepest, commas)


def parse_json(raw: bytes, max_depth: int, before=None):
    """The body's JSON value; a 400 for a body that is not JSON or nests deeper than `max_depth`. `before`:
    called with the body's JsonShape before it is parsed (a route's own refusal of what would be too big)."""
    shape = json_shape(raw)
    if shape.depth > max_depth:
        raise too_deep(f"{shape.depth} levels", max_depth)
    if before is not None:
        before(shape)
    try:
        return json.loads(raw)
    except RecursionError:  # the parser's own limit (Python's recursion limit) came first
        raise too_deep("too many levels", max_depth) from None
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON", "invalid_request") from None


def too_deep(what: str, max_depth: int) -> ApiError:
    return ApiError(400, f"the request body nests {what} deep; at most {max_depth} are accepted (--max-json-depth)",
                    "request_too_deep")


def count_items(data, fields=ITEM_FIELDS) -> int:
    """The request's items: the lists of `fields`, and the content blocks of their items (a tool result's
    blocks too). A completions prompt of token ids is one prompt, not items."""
    if not isinstance(data, dict):
        return 0
    total = 0
    for name in fields:
        value = data.get(name)
        if not isinstance(value, list) or (name == "prompt" and value and isinstance(value[0], int)):
            continue
        total += len(value)
        for item in value:
            content = item.get("content") if isinstance(item, dict) else None
            if isinstance(content, list):
                total += len(content)
                total += sum(len(block["content"]) for block in content
                             if isinstance(block, dict) and isinstance(block.get("content"), list))
    return total


def check_items(data, max_items: int, fields=ITEM_FIELDS) -> None:
    num_items = count_items(data, fields)
    if num_items > max_items:
        names = ", ".join(name for name in fields if isinstance(data.get(name), list))
        raise ApiError(400, f"the request has {num_items} items ({names}, with their content blocks); at most "
                       f"{max_items} are accepted (--max-request-items)", "too_many_items", names.split(",")[0])


def validated(model: type[BaseModel], data) -> BaseModel:
    """`model` from the parsed body; a 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, "invalid_request", param) from None


def parse_body(raw: bytes, model: type[BaseModel], settings, fields=ITEM_FIELDS, then=None, before=None):
    """In a worker thread: the body parsed (`before`: see parse_json), its items counted and validated as
    `model`; then `then(request)` when given (a route's translation, which may recurse over what the client
    sent), its result returned."""
    try:
        data = parse_json(raw, settings.max_json_depth, before)
        check_items(data, settings.max_request_items, fields)
        request = validated(model, data)
        return request if then is None else then(request)
    except RecursionError:
        raise too_deep("too many levels", settings.max_json_depth) from None


async def read_body(http_request, model: type[BaseModel], settings, fields=ITEM_FIELDS, then=None, before=None):
    """The request's body as `model` (see parse_body), read on the event loop and parsed off it."""
    raw = await http_request.body()
    return await asyncio.to_thread(parse_body, raw, model, settings, fields, then, before)
