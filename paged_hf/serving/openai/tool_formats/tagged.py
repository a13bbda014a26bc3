"""Tool-call formats with a tag per argument inside `<tool_call>...</tool_call>` blocks (Qwen3-Coder, GLM-4.5).

Their values are text. Qwen3-Coder's are typed by the request's tool schemas (`typed`: a parameter declared
other than a string is read as JSON; without a schema they stay strings, as vLLM's); GLM's are read as JSON,
else a Python literal, else the text. The arguments' JSON is written pair by pair in the order of the tags (a
name given twice is written twice: a JSON reader keeps the last, as vLLM's dict does), so that a stream sends
it as it grows: a closed block's call whole, the open block's as far as it is final (`calls_so_far`).
"""

from __future__ import annotations

import ast
import json
import re

from paged_hf.serving.openai.tool_formats.base import (
    CallSoFar,
    ToolParser,
    partial_marker_end,
    skip_space,
    whole_matches,
)


class _TaggedBlocksParser(ToolParser):
    """Calls in `<tool_call>` blocks after the content; every block must be closed and well formed."""

    marker = "<tool_call>"
    end = "</tool_call>"
    inner_markers = (end,)
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return text, []
        bodies = self._block.findall(text, start)
        if len(bodies) != text.count(self.marker, start):  # a block left open
            return text, []
        calls = [self._block_call(body) for body in bodies]
        if None in calls:
            return text, []
        return text[:start].strip(), calls

    def calls_so_far(self, raw, parameters_of=None):
        """Each closed block's call as `parse` and `typed` make it; then the open block's as far as it is final."""
        calls, opened = [], raw.find(self.marker)
        while opened >= 0:
            body_at = opened + len(self.marker)
            closed = raw.find(self.end, body_at)
            body = raw[body_at:closed if closed >= 0 else len(raw)]
            if self.marker in body:  # a block inside a block: no call (parse says the same)
                break
            call = self._block_call(body) if closed >= 0 else None
            if call is not None:
                schema = parameters_of(call[0]) if parameters_of else None
                calls.append(CallSoFar(call[0], self.typed(call[1], schema), True))
            elif closed < 0:
                calls += [c for c in [self._open_call(body, parameters_of)] if c is not None]
            if call is None:
                break
            opened = raw.find(self.marker, closed + len(self.end))
        return calls

    def _block_call(self, body: str) -> tuple[str, str] | None:
        raise NotImplementedError

    def _open_call(self, body: str, parameters_of) -> CallSoFar | None:
        """The call of a block not closed yet, once its name is written; its arguments as far as they are final."""
        raise NotImplementedError


def _pairs_text(pairs: list[tuple[str, str]]) -> str:
    """`{"key": value, ...}` from (key, value JSON) pairs: json.dumps's spelling of the same object."""
    return "{" + ", ".join(f"{json.dumps(key, ensure_ascii=False)}: {value}" for key, value in pairs) + "}"


class Qwen3CoderParser(_TaggedBlocksParser):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...</function>\\n</tool_call>`; a
    missing `</parameter>` ends at the next parameter or at `</function>` (vLLM's leniency)."""

    _function = re.compile(r"\s*<function=([^<>\s]+)>(.*)</function>\s*", re.S)
    _parameter = re.compile(r"<parameter=([^<>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
    _header = re.compile(r"\s*<function=([^<>\s]+)>")
    _parameter_start = re.compile(r"<parameter=([^<>\n]+)>")
    _value_ends = ("</parameter>", "<parameter=", "</function>", "</tool_call>")

    def _block_call(self, body):
        function = self._function.fullmatch(body)
        parameters = whole_matches(self._parameter, function[2]) if function else None
        if parameters is None:
            return None
        return function[1], _qwen3_arguments([(p[1], _trimmed(p[2])) for p in parameters], {})

    def typed(self, arguments, schema):
        """Values as the tool's schema types them (vLLM's reading with the request's tools): a parameter declared
        other than a string is read as JSON where it parses (`3` -> 3, `true` -> true); strings stay text."""
        pairs = json.loads(arguments, object_pairs_hook=list)
        if not isinstance(pairs, list) or not all(isinstance(p, tuple) and isinstance(p[1], str) for p in pairs):
            return arguments  # (not text values as parse gives them)
        return _qwen3_arguments(pairs, _properties(schema))

    def _open_call(self, body, parameters_of):
        header = self._header.match(body)
        if header is None:
            return None
        properties = _properties(parameters_of(header[1]) if parameters_of else None)
        function_end = body.find("</function>", header.end())  # (the last value's end is known at the block's)
        text = body[header.end():function_end if function_end >= 0 else len(body)]
        pairs, position = [], 0
        while (opened := self._parameter_start.match(text, skip_space(text, position))):
            ends = [i for i in (text.find("</parameter>", opened.end()), text.find("<parameter=", opened.end()))
                    if i >= 0]
            if not ends:  # the value being written: its key, and a string's text as far as it is final
                key = json.dumps(opened[1], ensure_ascii=False)
                return CallSoFar(header[1], _qwen3_arguments(pairs, properties)[:-1] + ", " * bool(pairs)
                                 + f"{key}: {self._open_value(opened[1], text[opened.end():], properties)}", False)
            pairs.append((opened[1], _trimmed(text[opened.end():min(ends)])))
            position = min(ends) + len("</parameter>") * text.startswith("</parameter>", min(ends))
        return CallSoFar(header[1], _qwen3_arguments(pairs, properties)[:-1], False)

    def _open_value(self, key: str, written: str, properties: dict) -> str:
        if _declared(key, properties) != "string":
            return ""  # read as JSON once whole
        written = written[:min(partial_marker_end(written, end) for end in self._value_ends)]
        written = written.removeprefix("\n") if written else written
        shown = written[:-1] if written.endswith("\n") else written  # (the value's last newline is the format's)
        return json.dumps(shown, ensure_ascii=False)[:-1]

    def format_calls(self, calls):
        return "\n".join(f"<tool_call>\n<function={name}>\n{_qwen3_parameters(arguments)}</function>\n</tool_call>"
                         for name, arguments in calls)

    def instructions(self):
        return ("To call a function, write:\n<tool_call>\n<function=<function-name>>\n<parameter=<name>>\n<value>\n"
                "</parameter>\n</function>\n</tool_call>\n(one <parameter> block per argument; values that are not "
                "strings written as JSON)")


def _trimmed(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


def _properties(schema) -> dict:
    properties = (schema or {}).get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _declared(key: str, properties: dict):
    declared = properties.get(key)
    return declared.get("type", "string") if isinstance(declared, dict) else "string"


def _qwen3_arguments(pairs: list[tuple[str, str]], properties: dict) -> str:
    """The arguments' JSON from (key, text) pairs: a value declared other than a string is read as JSON."""
    return _pairs_text([(key, json.dumps(value if _declared(key, properties) == "string" else _json_or_text(value),
                                         ensure_ascii=False)) for key, value in pairs])


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _qwen3_parameters(arguments: dict) -> str:
    return "".join(f"<parameter={key}>\n{_value_text(value)}\n</parameter>\n" for key, value in arguments.items())


class Glm45Parser(_TaggedBlocksParser):
    """`<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>`."""

    inner_markers = ("</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    _name = re.compile(r"\s*([^<>\s]+)(.*)", re.S)
    _argument = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
    _open_name = re.compile(r"\s*([^<>\s]+)(?=[\s<])")
    _key = re.compile(r"<arg_key>(.*?)</arg_key>", re.S)

    def _block_call(self, body):
        name = self._name.fullmatch(body)
        pairs = whole_matches(self._argument, name[2]) if name else None
        if pairs is None:
            return None
        values = [_glm_value(pair[2]) for pair in pairs]
        if None in values:
            return None
        return name[1], _pairs_text([(pair[1].strip(), value) for pair, value in zip(pairs, values)])

    def _open_call(self, body, parameters_of):
        """Each argument once its value is closed (a value's type is known when it is whole); the next key once
        it is."""
        name = self._open_name.match(body)
        if name is None:
            return None
        pairs, position = [], name.end()
        while (argument := self._argument.match(body, skip_space(body, position))):
            value = _glm_value(argument[2])
            if value is None:  # no JSON form: the block is no call
                return CallSoFar(name[1], _pairs_text(pairs)[:-1], False)
            pairs.append((argument[1].strip(), value))
            position = argument.end()
        arguments = _pairs_text(pairs)[:-1]
        key = self._key.match(body, skip_space(body, position))
        if key is not None:
            arguments += ", " * bool(pairs) + json.dumps(key[1].strip(), ensure_ascii=False) + ": "
        return CallSoFar(name[1], arguments, False)

    def format_calls(self, calls):
        return "".join(f"<tool_call>{name}\n{_glm_arguments(arguments)}</tool_call>" for name, arguments in calls)

    def instructions(self):
        return ("To call a function, write:\n<tool_call><function-name>\n<arg_key><name></arg_key>\n"
                "<arg_value><value></arg_value>\n</tool_call>\n(one key and value per argument; values that are not "
                "strings written as JSON)")


def _glm_value(written: str) -> str | None:
    """A value's JSON; None where the value has none (bytes, inf...)."""
    try:
        return json.dumps(_loose_value(written.strip()), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _glm_arguments(arguments: dict) -> str:
    return "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{_value_text(value)}</arg_value>\n"
                   for key, value in arguments.items())


def _value_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _loose_value(text: str):
    """A value written without a schema: JSON, else a Python literal, else the text itself (GLM's reading)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
