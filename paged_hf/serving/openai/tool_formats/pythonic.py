"""The pythonic tool-call format (Llama 3.2, Llama 4): the whole output is a Python list of calls,
`[get_weather(city='Paris'), get_time()]`, read with `ast` (keyword arguments with literal values only)."""

from __future__ import annotations

import ast

from paged_hf.serving.openai.tool_formats.base import ToolParser, dumps_arguments, may_open_with


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

    def format_calls(self, calls):
        written = (f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"
                   for name, arguments in calls)
        return f"[{', '.join(written)}]"

    def instructions(self):
        return ("To call functions, answer only with a Python list of calls with keyword arguments: "
                "[func_name1(param1=value1, param2=value2), func_name2(param=value)].")

    def safe_content_end(self, text, raw):
        return 0 if may_open_with(raw, (self.marker,)) else len(text)  # a call is all or nothing


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
