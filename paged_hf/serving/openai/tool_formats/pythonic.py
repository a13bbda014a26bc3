"""The pythonic tool-call format (Llama 3.2, Llama 4): the whole output is a Python list of calls,
`[get_weather(city='Paris'), get_time()]`, read with `ast` (keyword arguments with literal values only).

Streamed (`calls_so_far`), a call is announced once `NAME(` is written; its arguments grow argument by argument,
each once the comma after it is written (the call so far up to that comma, closed, is read with `ast` as the
whole will be), and the call's arguments are whole at its closing parenthesis."""

from __future__ import annotations

import ast
import re
from keyword import iskeyword

from paged_hf.serving.openai.tool_formats.base import (
    CallSoFar,
    ToolParser,
    dumps_arguments,
    may_open_with,
    skip_space,
)

_CALL_START = re.compile(r"(\w+)\s*\(")


class PythonicParser(ToolParser):
    marker = "["

    def parse(self, text):
        body = text.strip()
        if not body.startswith(self.marker):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        calls = [_python_call(node) for node in tree.elts] if isinstance(tree, ast.List) else []
        if not calls or None in calls:
            return text, []
        return "", calls

    def calls_so_far(self, raw, parameters_of=None):
        start = skip_space(raw, 0)
        if not raw.startswith(self.marker, start):
            return []
        calls, position = [], start + 1
        while (opened := _CALL_START.match(raw, skip_space(raw, position, ","))):
            if not opened[1].isidentifier() or iskeyword(opened[1]):
                break
            commas, end = _arguments_scan(raw, opened.end())
            if end is None:  # the call being written: its arguments up to the last comma
                arguments = _call_arguments(raw[opened.start():commas[-1]] + ")") if commas else "{}"
                calls.append(CallSoFar(opened[1], (arguments or "{}")[:-1], False))
                break
            arguments = _call_arguments(raw[opened.start():end])
            if arguments is None:
                break
            calls.append(CallSoFar(opened[1], arguments, True))
            position = end
        return calls

    def format_calls(self, calls):
        written = (f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"
                   for name, arguments in calls)
        return f"[{', '.join(written)}]"

    def instructions(self):
        return ("To call functions, answer only with a Python list of calls with keyword arguments: "
                "[func_name1(param1=value1, param2=value2), func_name2(param=value)].")

    def safe_content_end(self, text, raw):
        return 0 if may_open_with(raw, (self.marker,)) else len(text)  # a call is all or nothing


def _call_arguments(call_text: str) -> str | None:
    """The arguments' JSON of one call's text `name(...)`, as `parse` reads it in the list; None if it is none."""
    try:
        node = ast.parse(call_text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    call = _python_call(node)
    return None if call is None else call[1]


def _arguments_scan(text: str, start: int) -> tuple[list[int], int | None]:
    """(where the commas between a call's arguments are, the index after its closing parenthesis or None while it
    is open), scanning from after its `(`: brackets counted outside strings and comments. A miscount only holds
    arguments back: each is read with `ast` before it is sent."""
    commas, depth, position = [], 1, start
    while position < len(text):
        char = text[position]
        if char in "'\"":
            quote = char * 3 if text.startswith(char * 3, position) else char
            position = _string_end(text, position + len(quote), quote)
            if position is None:
                return commas, None
            continue
        if char == "#":
            newline = text.find("\n", position)
            position = len(text) if newline < 0 else newline
            continue
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if depth == 0:
            return commas, position + 1
        if char == "," and depth == 1:
            commas.append(position)
        position += 1
    return commas, None


def _string_end(text: str, position: int, quote: str) -> int | None:
    while position < len(text):
        if text[position] == "\\":
            position += 2
        elif text.startswith(quote, position):
            return position + len(quote)
        else:
            position += 1
    return None


def _python_call(node: ast.expr) -> tuple[str, str] | None:
    """`name(key=literal, ...)` as (name, arguments JSON); None for anything else (positional arguments,
    **kwargs, an expression that is not a literal, a value JSON cannot write)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(keyword.arg is None for keyword in node.keywords):
        return None
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    text = dumps_arguments(arguments)
    return None if text is None else (node.func.id, text)
