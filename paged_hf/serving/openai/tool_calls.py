"""Tool calling: `tools`/`tool_choice` in, OpenAI's `tool_calls` out.

- The tools go to the chat template (`tools=`). A template that ignores them gets them in a system message
  instead, written in the format the tool-call parser reads, so the model still sees them.
- `tool_choice` "required" or a named function is enforced with a JSON schema (structured outputs): a list of
  calls, or the named function's arguments. "auto" lets the model write; the parser chosen with
  `--tool-call-parser` (hermes, llama3_json, pythonic, mistral, granite, qwen3_coder, glm45, deepseek_v3,
  deepseek_v31, kimi_k2) finds the calls in its output.
- Parsers are in tool_parsers.py (formats in tool_formats/); the streaming side (deltas in OpenAI's shape) in
  `ToolCallStreamer`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_hf.sampling_params import StructuredOutputsParams
from paged_hf.serving.openai.errors import ApiError
from paged_hf.serving.openai.tool_parsers import (
    PARSERS,
    ToolParser,
    parse_required,
    required_calls_so_far,
    tool_text,
)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(BaseModel):
    id: str = Field(default_factory=new_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


@dataclass
class ToolMode:
    """What the request allows: "none", "auto", "required" or "named" (`name`)."""

    kind: str = "none"
    tools: list[ChatTool] = field(default_factory=list)
    name: str | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The schema that enforces "required" (a non-empty list of calls) or a named function (its arguments)."""
        if self.kind == "named":
            tool = next(t for t in self.tools if t.function.name == self.name)
            return StructuredOutputsParams(json=_parameters(tool))
        if self.kind == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)}}
                     for t in self.tools]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
        return None


    def parameters_of(self, name: str) -> dict | None:
        """The JSON schema of the parameters of the tool called `name`; None for a tool the request has not."""
        tool = next((t for t in self.tools if t.function.name == name), None)
        return None if tool is None else _parameters(tool)


def _parameters(tool: ChatTool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_mode(request) -> ToolMode:
    """Checks `tools` against `tool_choice` (400 naming the field)."""
    tools = list(getattr(request, "tools", None) or [])
    choice = getattr(request, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "invalid_request", "tool_choice")
        return ToolMode()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"tools have duplicate function names: {names}", "invalid_request", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
                           "invalid_request", "tool_choice")
        return ToolMode("named", tools, choice.function.name)
    return ToolMode(choice or "auto", tools)


def template_messages(messages: list[dict], mode: ToolMode, parser: ToolParser, template: str | None
                      ) -> tuple[list[dict], dict]:
    """The messages and extra template arguments. Assistant tool calls get dict arguments (what HF templates
    expect); a template without tools gets them (and earlier calls) as text in the parser's format."""
    messages = [_with_dict_arguments(m) for m in messages]
    if mode.kind == "none":
        return messages, {}
    tools = [t.model_dump(exclude_none=True) for t in mode.tools]
    if template and "tools" in template:
        return messages, {"tools": tools}
    messages = [_calls_as_text(m, parser) for m in messages]
    prompt = parser.system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}"}, *messages[1:]], {}
    return [{"role": "system", "content": prompt}, *messages], {}


def _with_dict_arguments(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                raise ApiError(400, f"tool call arguments are not JSON: {function['arguments']!r}",
                               "invalid_messages", "messages") from None
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


def _calls_as_text(message: dict, parser: ToolParser) -> dict:
    calls = message.pop("tool_calls", None) if message.get("tool_calls") else None
    if not calls:
        return message
    text = parser.format_calls([(c["function"]["name"], c["function"].get("arguments", {})) for c in calls])
    return {**message, "content": f"{message.get('content') or ''}{text}"}


def parse_output(mode: ToolMode, parser: ToolParser, tokenizer, completion) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished sequence; no calls found: its text is the content."""
    text = completion.text or ""
    if mode.kind == "none":
        return text, []
    if mode.kind == "named":
        return None, [ToolCall(function=FunctionCall(name=mode.name, arguments=text))]
    if mode.kind == "required":
        calls = parse_required(text)
    else:
        content, calls = parser.parse(tool_text(tokenizer, completion.token_ids, parser))
        if calls:
            text = content
            calls = [(name, parser.typed(arguments, mode.parameters_of(name))) for name, arguments in calls]
    if not calls:
        return text, []
    return (text or None) if mode.kind == "auto" else None, [
        ToolCall(function=FunctionCall(name=name, arguments=arguments)) for name, arguments in calls]


def finish_reason(completion, calls: list[ToolCall]) -> str | None:
    """A sequence that ended with tool calls reports "tool_calls" (a cut one keeps "length")."""
    return "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason


class ToolCallStreamer:
    """Streams one request's sequences: content as it comes until a tool call may be starting, then the calls.

    A named function's arguments stream as they are generated. In "auto" and "required", a call goes out (id,
    name) once its name is written and its arguments as the model writes them (OpenAI's deltas: their
    concatenation is the call's `arguments`), as far as they are final (`calls_so_far`: the JSON formats' text
    as written; qwen3_coder's JSON as it is built, a string value character by character; glm45's and
    pythonic's argument by argument). What the final parse finds is the answer: a call it does not confirm (cut
    or malformed) has had deltas that cannot be taken back, and gets the rest of what was written of it.
    """

    def __init__(self, mode: ToolMode, parser: ToolParser, tokenizer):
        self.mode, self.parser, self.tokenizer = mode, parser, tokenizer
        self.content_sent: dict[int, int] = {}  # index -> characters of content sent
        self.started: set[int] = set()  # indexes whose named call's header went out
        self.calls_sent: dict[int, list[list[str]]] = {}  # index -> [call id, arguments sent] per call announced

    def delta(self, completion, new_text: str) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        """(content, tool call deltas, finish_reason) to send for this sequence's new text."""
        done = completion.finish_reason is not None
        if self.mode.kind == "named":
            named_finish = "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason
            return None, self._named(completion.index, new_text), named_finish
        raw = tool_text(self.tokenizer, completion.token_ids, self.parser)
        if not done:
            calls = self._growing(completion.index, self._so_far(completion, raw))
            return self._content(completion, raw), calls or None, None
        content, calls = parse_output(self.mode, self.parser, self.tokenizer, completion)
        if not calls:  # (calls already announced, cut or malformed, get the rest of what was written of them)
            announced = self._so_far(completion, raw)[:len(self.calls_sent.get(completion.index, []))]
            return (self._content(completion, raw, final=True), self._growing(completion.index, announced) or None,
                    completion.finish_reason)
        return (self._rest(completion.index, content or ""), self._final(completion.index, calls),
                finish_reason(completion, calls))

    def _so_far(self, completion, raw: str) -> list:
        if self.mode.kind == "required":
            return required_calls_so_far(completion.text or "")
        return self.parser.calls_so_far(raw, self.mode.parameters_of) or []

    def _growing(self, index: int, calls) -> list[DeltaToolCall]:
        """Deltas for the calls written so far: a new call's id and name, then its arguments' new text."""
        sent, deltas = self.calls_sent.setdefault(index, []), []
        for i, call in enumerate(calls):
            if i == len(sent):
                sent.append([new_call_id(), ""])
                deltas.append(DeltaToolCall(index=i, id=sent[i][0], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments="")))
            if call.arguments.startswith(sent[i][1]) and len(call.arguments) > len(sent[i][1]):
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(
                    arguments=call.arguments[len(sent[i][1]):])))
                sent[i][1] = call.arguments
        return deltas

    def _final(self, index: int, calls: list[ToolCall]) -> list[DeltaToolCall]:
        """The rest of each call (all of one not announced yet); the calls keep the ids their deltas had."""
        sent, deltas = self.calls_sent.get(index, []), []
        for i, call in enumerate(calls):
            if i < len(sent):
                call.id, already = sent[i]
                rest = call.function.arguments[len(already):] if call.function.arguments.startswith(already) else ""
                if rest:
                    deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=rest)))
            else:
                deltas.append(DeltaToolCall(index=i, id=call.id, type="function", function=DeltaFunctionCall(
                    name=call.function.name, arguments=call.function.arguments)))
        return deltas

    def _named(self, index: int, new_text: str) -> list[DeltaToolCall] | None:
        if index not in self.started:
            self.started.add(index)
            return [DeltaToolCall(index=0, id=new_call_id(), type="function",
                                  function=DeltaFunctionCall(name=self.mode.name, arguments=new_text))]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new_text))] if new_text else None

    def _content(self, completion, raw: str, final: bool = False) -> str | None:
        if self.mode.kind == "required":
            return None
        text = completion.text or ""
        if not final:
            text = text[: self.parser.safe_content_end(text, raw)]
        return self._rest(completion.index, text)

    def _rest(self, index: int, text: str) -> str | None:
        sent = self.content_sent.get(index, 0)
        self.content_sent[index] = max(sent, len(text))
        return text[sent:] or None


def parser_for(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]
