"""Tool-call formats with a tag per argument inside `<tool_call>...</tool_call>` blocks (Qwen3-Coder, GLM-4.5).

Their values are text. Qwen3-Coder's are typed by the request's tool schemas (`typed`: a parameter declared
other than a string is read as JSON; without a schema they stay strings, as vLLM's); GLM's are read as JSON,
else a Python literal, else the text.
"""

from __future__ import annotations

import ast
import json
import re

from paged_hf.serving.openai.tool_formats.base import ToolParser, dumps_arguments, whole_matches


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

    def _block_call(self, body: str) -> tuple[str, str] | None:
        raise NotImplementedError


class Qwen3CoderParser(_TaggedBlocksParser):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...</function>\\n</tool_call>`; a
    missing `</parameter>` ends at the next parameter or at `</function>` (vLLM's leniency)."""

    _function = re.compile(r"\s*<function=([^<>\s]+)>(.*)</function>\s*", re.S)
    _parameter = re.compile(r"<parameter=([^<>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)

    def _block_call(self, body):
        function = self._function.fullmatch(body)
        parameters = whole_matches(self._parameter, function[2]) if function else None
        if parameters is None:
            return None
        arguments = {p[1]: p[2].removeprefix("\n").removesuffix("\n") for p in parameters}
        return function[1], json.dumps(arguments, ensure_ascii=False)

    def typed(self, arguments, schema):
        """Values as the tool's schema types them (vLLM's reading with the request's tools): a parameter declared
        other than a string is read as JSON where it parses (`3` -> 3, `true` -> true); strings stay text."""
        properties = (schema or {}).get("properties") or {}
        values = json.loads(arguments)
        for key, value in values.items():
            declared = (properties.get(key) or {}).get("type", "string")
            if declared != "string" and isinstance(value, str):
                values[key] = _json_or_text(value)
        return json.dumps(values, ensure_ascii=False)

    def format_calls(self, calls):
        return "\n".join(f"<tool_call>\n<function={name}>\n{_qwen3_parameters(arguments)}</function>\n</tool_call>"
                         for name, arguments in calls)

    def instructions(self):
        return ("To call a function, write:\n<tool_call>\n<function=<function-name>>\n<parameter=<name>>\n<value>\n"
                "</parameter>\n</function>\n</tool_call>\n(one <parameter> block per argument; values that are not "
                "strings written as JSON)")


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

    def _block_call(self, body):
        name = self._name.fullmatch(body)
        pairs = whole_matches(self._argument, name[2]) if name else None
        if pairs is None:
            return None
        arguments = dumps_arguments({pair[1].strip(): _loose_value(pair[2].strip()) for pair in pairs})
        return None if arguments is None else (name[1], arguments)

    def format_calls(self, calls):
        return "".join(f"<tool_call>{name}\n{_glm_arguments(arguments)}</tool_call>" for name, arguments in calls)

    def instructions(self):
        return ("To call a function, write:\n<tool_call><function-name>\n<arg_key><name></arg_key>\n"
                "<arg_value><value></arg_value>\n</tool_call>\n(one key and value per argument; values that are not "
                "strings written as JSON)")


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
