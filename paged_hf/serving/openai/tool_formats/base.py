"""What every tool-call format shares: the `ToolParser` interface and the small pieces its parsers are made of.

A parser is all or nothing: a call it cannot read whole (broken JSON, a tag left open, a cut section) makes
the whole text content, as vLLM does, and never raises.
"""

from __future__ import annotations

import json
import re


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

    def safe_content_end(self, text: str, raw: str) -> int:
        """How much of `text` (the sequence's text so far) is surely content, not the start of a call."""
        if self.marker in raw:
            return min(len(text), max(raw.find(self.marker), 0))
        return partial_marker_end(text, self.marker)
