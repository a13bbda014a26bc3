"""Tool-call formats whose calls are JSON objects `{"name": ..., "arguments": {...}}` (Hermes, Llama 3, Mistral,
Granite)."""

from __future__ import annotations

import json
import re

from paged_hf.serving.openai.tool_formats.base import (
    CallSoFar,
    ToolParser,
    json_call,
    json_values,
    may_open_with,
    object_calls,
    skip_space,
)


class HermesParser(ToolParser):
    marker = "<tool_call>"
    _calls = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for body in self._calls.findall(text[start:]):
            values = json_values(body)
            parsed = [json_call(v) for v in values or []]
            if not values or None in parsed:
                return text, []
            calls += parsed
        return text[:start].strip(), as_written(calls, self.calls_so_far(text))

    def calls_so_far(self, raw, parameters_of=None):
        calls = []
        for opened in re.finditer(re.escape(self.marker), raw):
            calls += object_calls(raw, opened.end())
            if not calls or not calls[-1].complete:
                break
        return calls

    def format_calls(self, calls):
        return "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                       for n, a in calls)

    def instructions(self):
        return ('For each call, write a JSON object with the function name and arguments within <tool_call>'
                '</tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
                '</tool_call>')


class Llama3JsonParser(ToolParser):
    marker = "<|python_tag|>"

    def parse(self, text):
        body = text.strip().removeprefix(self.marker).strip()
        if not body.startswith("{"):
            return text, []
        values = json_values(body)
        parsed = [json_call(v, ("parameters", "arguments")) for v in values or []]
        if not values or None in parsed:
            return text, []
        return "", as_written(parsed, self.calls_so_far(text))

    def calls_so_far(self, raw, parameters_of=None):
        start = skip_space(raw, 0)
        start = start + len(self.marker) if raw.startswith(self.marker, start) else start
        return object_calls(raw, start)

    def format_calls(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def instructions(self):
        return ('To call a function, answer only with a JSON object {"name": <function-name>, "parameters": '
                '<args-json-object>} (several separated by "; ").')

    def safe_content_end(self, text, raw):
        return 0 if may_open_with(raw, ("{", self.marker)) else len(text)  # a call is all or nothing


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        values = json_values(text[start + len(self.marker):])
        if not values:
            return text, []
        items = [item for v in values for item in (v if isinstance(v, list) else [v])]
        parsed = [json_call(item) for item in items]
        if not parsed or None in parsed:
            return text, []
        return text[:start].strip(), as_written(parsed, self.calls_so_far(text))

    def calls_so_far(self, raw, parameters_of=None):
        return _listed_calls(raw, raw.find(self.marker), self.marker)

    def format_calls(self, calls):
        return self.marker + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def instructions(self):
        return ('To call functions, write [TOOL_CALLS] followed by a JSON list '
                '[{"name": <function-name>, "arguments": <args-json-object>}, ...].')


class GraniteParser(ToolParser):
    """Granite 3.x: the whole output is `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (3.1 may write
    the string `<tool_call>` instead of the token; both, or neither, may come before the list)."""

    marker = "<|tool_call|>"
    _string_marker = "<tool_call>"

    def parse(self, text):
        body = text.strip().removeprefix(self.marker).lstrip().removeprefix(self._string_marker).lstrip()
        if not body.startswith("["):
            return text, []
        try:
            values = json.loads(body)
        except ValueError:
            return text, []
        parsed = [_granite_call(v) for v in values]
        if not parsed or None in parsed:
            return text, []
        return "", as_written(parsed, self.calls_so_far(text))

    def calls_so_far(self, raw, parameters_of=None):
        start = skip_space(raw, 0)
        for marker in (self.marker, self._string_marker):
            start = skip_space(raw, start + len(marker)) if raw.startswith(marker, start) else start
        return _listed_calls(raw, start, "")

    def format_calls(self, calls):
        return self.marker + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def instructions(self):
        return ('To call functions, answer only with <|tool_call|> followed by a JSON list '
                '[{"name": <function-name>, "arguments": <args-json-object>}, ...].')

    def safe_content_end(self, text, raw):
        return 0 if may_open_with(raw, ("[", self.marker, self._string_marker)) else len(text)


def _granite_call(value) -> tuple[str, str] | None:
    """A call whose arguments are an object (Granite writes no other kind)."""
    if not isinstance(value, dict) or not isinstance(value.get("arguments", {}), dict):
        return None
    return json_call(value, ("arguments",))


def _listed_calls(raw: str, at: int, marker: str) -> list[CallSoFar]:
    """The calls of a JSON list `[{...}, ...]` that starts after `marker` at `at` (-1: not written yet)."""
    if at < 0:
        return []
    start = skip_space(raw, at + len(marker))
    return object_calls(raw, start + 1) if raw.startswith("[", start) else []


def as_written(calls: list[tuple[str, str]], written: list[CallSoFar]) -> list[tuple[str, str]]:
    """The calls with their arguments as the model wrote them (what a stream sends piece by piece), where the
    scan of the text found the same calls whole; else as parsed."""
    if len(written) != len(calls) or any(not w.complete or w.name != name for w, (name, _) in zip(written, calls)):
        return calls
    return [(w.name, w.arguments) for w in written]
