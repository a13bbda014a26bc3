"""Finding tool calls in a model's text, one parser per format (vLLM's `--tool-call-parser` names).

- hermes (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after content.
- llama3_json (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after content.

Each parser also writes calls in its own format (for templates that cannot render tools) and says how much
of a running text is surely content (a stream holds back what may be the start of a call).
"""

from __future__ import annotations

import json
import re


def _args_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _call(obj, args_keys=("arguments", "parameters")) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in args_keys if k in obj), {})
    return obj["name"], _args_text(arguments)


def _json_values(text: str) -> list | None:
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


def _partial_marker_end(text: str, marker: str) -> int:
    """len(text) minus the longest suffix of `text` that is a prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class ToolParser:
    marker = ""

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

    def safe_content_end(self, text: str, raw: str) -> int:
        """How much of `text` (the sequence's text so far) is surely content, not the start of a call."""
        if self.marker in raw:
            return min(len(text), max(raw.find(self.marker), 0))
        return _partial_marker_end(text, self.marker)


class HermesParser(ToolParser):
    marker = "<tool_call>"
    _calls = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for body in self._calls.findall(text[start:]):
            values = _json_values(body)
            parsed = [_call(v) for v in values or []]
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
        values = _json_values(body)
        parsed = [_call(v, ("parameters", "arguments")) for v in values or []]
        if not values or None in parsed:
            return text, []
        return "", parsed

    def format_calls(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def instructions(self):
        return ('To call a function, answer only with a JSON object {"name": <function-name>, "parameters": '
                '<args-json-object>} (several separated by "; ").')

    def safe_content_end(self, text, raw):
        stripped = raw.strip()
        if not stripped or stripped.startswith("{") or self.marker.startswith(stripped[:len(self.marker)]):
            return 0  # a call may be starting: it is all or nothing
        return len(text)


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        values = _json_values(text[start + len(self.marker):])
        if not values:
            return text, []
        items = [item for v in values for item in (v if isinstance(v, list) else [v])]
        parsed = [_call(item) for item in items]
        if not parsed or None in parsed:
            return text, []
        return text[:start].strip(), parsed

    def format_calls(self, calls):
        return self.marker + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def instructions(self):
        return ('To call functions, write [TOOL_CALLS] followed by a JSON list '
                '[{"name": <function-name>, "arguments": <args-json-object>}, ...].')


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(),
                                  "mistral": MistralParser()}


def parse_required(text: str) -> list[tuple[str, str]]:
    """The calls of a "required" answer (a JSON list of {"name", "arguments"}); [] if it is not one."""
    try:
        values = json.loads(text)
    except ValueError:
        return []
    parsed = [_call(v) for v in values] if isinstance(values, list) else [None]
    return [] if None in parsed else parsed


def tool_text(tokenizer, token_ids: list[int], parser: ToolParser) -> str:
    """The sequence's text with the parser's marker kept even where it is a special token (Mistral's
    [TOOL_CALLS]); other special tokens (EOS...) are dropped as in the normal text."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    for special in getattr(tokenizer, "all_special_tokens", []):
        if special and special != parser.marker:
            text = text.replace(special, "")
    return text
