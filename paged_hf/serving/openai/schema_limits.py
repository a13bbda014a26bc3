"""Every JSON schema a request carries, held to the engine's `--max-grammar-depth`, on every route.

The engine checks a schema's depth when it becomes a grammar (response_format, structured_outputs, a
required or named tool_choice). A tool's schema under `tool_choice` auto or none never does: it goes to the
chat template, whose `tojson` recurses over it, and into the stored response. So the server checks them all
itself, before anything renders, with the same limit and the same wording.
"""

from __future__ import annotations

from paged_hf.serving.openai.errors import ApiError


def nesting(value, limit: int) -> int:
    """How deep dicts and lists nest in `value`, counted without recursion; stops once past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in item if isinstance(child, (dict, list)))
    return deepest


def check_schema(schema, where: str, max_depth: int) -> None:
    if nesting(schema, max_depth) > max_depth:
        raise ApiError(400, f"{where} nests more than {max_depth} levels deep; at most max_grammar_depth="
                       f"{max_depth} are accepted (--max-grammar-depth)", "schema_too_deep",
                       where.split("[")[0].split(".")[0])


def check_request_schemas(request, max_depth: int) -> None:
    """A 400 naming the schema and the limit for one nested deeper than `max_depth` (tools' parameters,
    response_format's json_schema, structured_outputs' json)."""
    for i, tool in enumerate(getattr(request, "tools", None) or []):
        if tool.function.parameters is not None:
            check_schema(tool.function.parameters, f"tools[{i}].function.parameters", max_depth)
    response_format = getattr(request, "response_format", None)
    schema = getattr(getattr(response_format, "json_schema", None), "schema_", None)
    if schema is not None:
        check_schema(schema, "response_format.json_schema.schema", max_depth)
    fields = getattr(request, "structured_outputs", None)
    if isinstance(fields, dict) and isinstance(fields.get("json"), (dict, list)):
        check_schema(fields["json"], "structured_outputs.json", max_depth)
