"""gpt-oss's tool calls (harmony): a `commentary` message to `functions.NAME` whose body is the arguments' JSON,
ended by `<|call|>`. The answer around them is the `final` channel's text; the thinking is the `openai_gptoss`
reasoning parser's (which this parser needs: it keeps the format's special tokens in the text)."""

from __future__ import annotations

from paged_hf.serving.openai import harmony
from paged_hf.serving.openai.tool_formats.base import (
    CallSoFar,
    ToolParser,
    args_text,
    json_object_text,
    json_value_end,
    skip_space,
)


class HarmonyParser(ToolParser):
    marker = harmony.START
    inner_markers = tuple(m for m in harmony.MARKERS if m != harmony.START)

    def parse(self, text):
        calls = harmony.tool_calls(text)
        arguments = [json_object_text(body) for _, body in calls or []]
        if not calls or None in arguments:
            return text, []
        _, answer = harmony.thinking_and_answer(text)
        return (answer or "").strip(), [(name, body) for (name, _), body in zip(calls, arguments)]

    def format_calls(self, calls):
        return "".join(harmony.call_text(name, args_text(arguments)) for name, arguments in calls)

    def instructions(self):
        return ("To call a function, write a commentary message to it: <|start|>assistant<|channel|>commentary "
                "to=functions.<function-name> <|constrain|>json<|message|><args-json-object><|call|>")

    def calls_so_far(self, raw, parameters_of=None):
        calls = []
        for message in harmony.messages(raw):
            if message.recipient is None or not message.recipient.startswith("functions."):
                continue
            value_at = skip_space(message.body, 0)
            end = json_value_end(message.body, value_at)
            calls.append(CallSoFar(message.recipient.removeprefix("functions."),
                                   message.body[value_at:len(message.body) if end is None else end], end is not None))
            if end is None:
                break
        return calls

    def safe_content_end(self, text, raw):
        return len(text)  # the answer's text holds no call: calls are messages of their own
