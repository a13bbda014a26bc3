"""Tool-call formats whose calls are JSON objects `{"name": ..., "arguments": {...}}` (Hermes, Llama 3, Mistral,
Granite)."""

from __future__ import annotations

import json
import re

from paged_hf.serving.openai.tool_formats.base import ToolParser, json_call, json_values, may_open_with


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
        return text[:start].strip(), calls

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
        return "", parsed

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
        return text[:start].strip(), parsed

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
        return "", parsed

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
