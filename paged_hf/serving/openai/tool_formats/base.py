"""What every tool-call format shares: the `ToolParser` interface and the small pieces its parsers are made of.

A parser is all or nothing: a call it cannot read whole (broken JSON, a tag left open, a cut section) makes
the whole text content, as vLLM does, and never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


def args_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def json_call(obj, args_keys=("arguments", "parameters")) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in args_keys if k in obj), {})
    return obj["name"], args_text(arguments)


def json_values(text: str) -> list | None:
    """Consecutive JSON values in `text` (separated by whitespace or ';'), or None if anything else is there."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        values.append(value)


def json_object_text(text: str) -> str | None:
    """`text` stripped if it is one JSON object (arguments kept as the model wrote them), else None."""
    text = text.strip()
    try:
        return text if isinstance(json.loads(text), dict) else None
    except ValueError:
        return None


def dumps_arguments(arguments: dict) -> str | None:
    """Arguments read from a non-JSON format as JSON text; None if a value has no JSON form (bytes, inf...)."""
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


def whole_matches(pattern: re.Pattern, text: str) -> list[re.Match] | None:
    """The matches of `pattern` that make up all of `text` (whitespace between them allowed), or None if
    anything else is there: a call with stray text inside is not read as a call."""
    matches, position = [], 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return matches
        match = pattern.match(text, position)
        if match is None or match.end() == position:
            return None
        matches.append(match)
        position = match.end()


def partial_marker_end(text: str, marker: str) -> int:
    """len(text) minus the longest suffix of `text` that is a prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def may_open_with(raw: str, openings: tuple[str, ...]) -> bool:
    """Whether the text so far starts, or may still start, with one of `openings` (leading space aside): for
    formats whose calls are the whole output, where nothing is surely content before the first characters."""
    stripped = raw.strip()
    return not stripped or any(stripped.startswith(o) or o.startswith(stripped) for o in openings)


@dataclass
class CallSoFar:
    """A call as far as it is written: its name (known once written whole) and its arguments' raw text so far."""

    name: str
    arguments: str
    complete: bool  # the arguments' JSON value is closed


def skip_space(text: str, position: int, also: str = "") -> int:
    while position < len(text) and (text[position].isspace() or text[position] in also):
        position += 1
    return position


def json_value_end(text: str, start: int) -> int | None:
    """The index after the JSON value that starts at `start`, or None while it is still open (brackets are
    counted outside strings; a number or literal may still grow until something follows it)."""
    if start >= len(text):
        return None
    if text[start] == '"':
        return _string_end(text, start)
    if text[start] not in "{[":
        end = start
        while end < len(text) and text[end] not in ",}] \t\r\n;<":
            end += 1
        return end if end < len(text) else None
    depth, position = 0, start
    while position < len(text):
        char = text[position]
        if char == '"':
            end = _string_end(text, position)
            if end is None:
                return None
            position = end
            continue
        depth += 1 if char in "{[" else -1 if char in "}]" else 0
        position += 1
        if depth == 0:
            return position
    return None


def _string_end(text: str, start: int) -> int | None:
    position = start + 1
    while position < len(text):
        if text[position] == "\\":
            position += 2
        elif text[position] == '"':
            return position + 1
        else:
            position += 1
    return None


def object_calls(text: str, start: int, args_keys=("arguments", "parameters"), between: str = ",;"
                 ) -> list[CallSoFar]:
    """The `{"name": ..., "arguments": {...}}` objects written from `start` on (separated by whitespace and
    `between`), as far as they are written: the scan stops at anything else, and at a call whose name is not
    whole yet (it cannot be announced)."""
    calls, position = [], skip_space(text, start, between)
    while position < len(text) and text[position] == "{":
        call, end = _object_call(text, position, args_keys)
        if call is None:
            break
        calls.append(call)
        if end is None:
            break
        position = skip_space(text, end, between)
    return calls


def _object_call(text: str, start: int, args_keys) -> tuple[CallSoFar | None, int | None]:
    """(the call in the object at `start` so far, None before its name is whole; the object's end, or None)."""
    name, arguments, complete, position = None, "", False, start + 1
    while True:
        position = skip_space(text, position, ",")
        if position >= len(text) or text[position] != '"':
            if position < len(text) and text[position] == "}":
                arguments, complete = (arguments, complete) if complete else ("{}", True)
                return (None if name is None else CallSoFar(name, arguments, complete)), position + 1
            break  # still open (or not a call's object: the final parse decides)
        key_end = json_value_end(text, position)
        colon = skip_space(text, key_end) if key_end is not None else len(text)
        if colon >= len(text) or text[colon] != ":":
            break
        key, value_at = _json_string(text[position:key_end]), skip_space(text, colon + 1)
        end = json_value_end(text, value_at)
        if key is None:
            break  # not JSON (a bad escape...): no call, the final parse says the same
        if key == "name" and end is not None and text[value_at] == '"':
            name = _json_string(text[value_at:end])
            if name is None:
                break
        elif key in args_keys:
            arguments, complete = text[value_at:len(text) if end is None else end], end is not None
        if end is None:
            break
        position = end
    return (None if name is None else CallSoFar(name, arguments, complete)), None


def _json_string(written: str) -> str | None:
    """A JSON string's value; None where it is not one (a bad escape, a raw control character)."""
    try:
        return json.loads(written)
    except ValueError:
        return None


class ToolParser:
    marker = ""  # where the calls start (kept by tool_text even where it is a special token)
    inner_markers: tuple[str, ...] = ()  # the format's other markers, kept by tool_text likewise

    def parse(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """(content before the calls, [(name, arguments JSON)]); no calls: (text, [])."""
        raise NotImplementedError

    def format_calls(self, calls: list[tuple[str, object]]) -> str:
        raise NotImplementedError

    def instructions(self) -> str:
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return (f"You may call functions to answer the user. The available tools:\n<tools>\n{listing}\n</tools>\n"
                f"{self.instructions()}")

    def typed(self, arguments: str, schema: dict | None) -> str:
        """A call's arguments JSON typed by the tool's parameters `schema` (formats that write values as text)."""
        return arguments

    def calls_so_far(self, raw: str, parameters_of=None) -> list[CallSoFar] | None:
        """The calls written so far in a running text (`tool_text`), for streaming their arguments as they are
        written: each call's arguments as far as they are final (a prefix of what `parse`, then `typed` with
        `parameters_of(name)`, makes of the whole text); None for a format whose calls go out whole."""
        return None

    def safe_content_end(self, text: str, raw: str) -> int:
        """How much of `text` (the sequence's text so far) is surely content, not the start of a call."""
        if self.marker in raw:
            return min(len(text), max(raw.find(self.marker), 0))
        return partial_marker_end(text, self.marker)
