"""Tool-call formats made of the model's own special tokens: one section of calls after the content (DeepSeek
V3 and V3.1, Kimi K2). The section must be closed and hold nothing but well-formed calls whose arguments are a
JSON object (kept as the model wrote them); text after the section is dropped, as vLLM does."""

from __future__ import annotations

import re

from paged_hf.serving.openai.tool_formats.base import (
    CallSoFar,
    ToolParser,
    args_text,
    json_object_text,
    json_value_end,
    skip_space,
    whole_matches,
)


def _deepseek_token(words: str) -> str:
    """DeepSeek's tokens are written with full-width bars (U+FF5C) and U+2581 in place of spaces."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = _deepseek_token("tool calls begin"), _deepseek_token("tool calls end")
DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END = _deepseek_token("tool call begin"), _deepseek_token("tool call end")
DEEPSEEK_SEP = _deepseek_token("tool sep")
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGUMENTS_BEGIN, KIMI_CALL_END = (
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")


class _SectionParser(ToolParser):
    end = ""
    _call_header: re.Pattern  # a call up to its arguments (group "name")
    _call_pattern: re.Pattern  # a whole call: the header, then group "arguments"

    def calls_so_far(self, raw, parameters_of=None):
        start = raw.find(self.marker)
        calls = []
        for header in self._call_header.finditer(raw, start + len(self.marker)) if start >= 0 else ():
            value_at = skip_space(raw, header.end())
            end = json_value_end(raw, value_at)
            calls.append(CallSoFar(self._name(header["name"]), raw[value_at:len(raw) if end is None else end],
                                   end is not None))
            if end is None:
                break
        return calls

    def parse(self, text):
        start = text.find(self.marker)
        end = text.find(self.end, start + len(self.marker)) if start >= 0 else -1
        if end < 0:  # no section, or one left open
            return text, []
        matches = whole_matches(self._call_pattern, text[start + len(self.marker):end])
        calls = [self._call(match) for match in matches or []]
        if not calls or None in calls:
            return text, []
        return text[:start].strip(), calls

    def _call(self, match: re.Match) -> tuple[str, str] | None:
        arguments = json_object_text(match["arguments"])
        return None if arguments is None else (self._name(match["name"]), arguments)

    def _name(self, written: str) -> str:
        return written.strip()


class DeepSeekV3Parser(_SectionParser):
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    ...<｜tool▁calls▁end｜>`."""

    marker, end = DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END
    inner_markers = (DEEPSEEK_CALLS_END, DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, DEEPSEEK_SEP)
    _call_header = re.compile(
        rf"{re.escape(DEEPSEEK_CALL_BEGIN)}function{re.escape(DEEPSEEK_SEP)}(?P<name>[^<>\n]+)\n```json")
    _call_pattern = re.compile(
        rf"{_call_header.pattern}\s*(?P<arguments>.*?)\s*```\s*{re.escape(DEEPSEEK_CALL_END)}", re.S)

    def format_calls(self, calls):
        written = "\n".join(f"{DEEPSEEK_CALL_BEGIN}function{DEEPSEEK_SEP}{name}\n```json\n{args_text(arguments)}"
                            f"\n```{DEEPSEEK_CALL_END}" for name, arguments in calls)
        return f"{DEEPSEEK_CALLS_BEGIN}{written}{DEEPSEEK_CALLS_END}"

    def instructions(self):
        return (f"To call functions, write {DEEPSEEK_CALLS_BEGIN}, then for each call {DEEPSEEK_CALL_BEGIN}function"
                f"{DEEPSEEK_SEP}<function-name>\n```json\n<args-json-object>\n```{DEEPSEEK_CALL_END}, then "
                f"{DEEPSEEK_CALLS_END}.")


class DeepSeekV31Parser(_SectionParser):
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`."""

    marker, end = DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END
    inner_markers = (DEEPSEEK_CALLS_END, DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, DEEPSEEK_SEP)
    _call_header = re.compile(rf"{re.escape(DEEPSEEK_CALL_BEGIN)}(?P<name>[^<>]+?){re.escape(DEEPSEEK_SEP)}")
    _call_pattern = re.compile(rf"{_call_header.pattern}(?P<arguments>.*?){re.escape(DEEPSEEK_CALL_END)}", re.S)

    def format_calls(self, calls):
        written = "".join(f"{DEEPSEEK_CALL_BEGIN}{name}{DEEPSEEK_SEP}{args_text(arguments)}{DEEPSEEK_CALL_END}"
                          for name, arguments in calls)
        return f"{DEEPSEEK_CALLS_BEGIN}{written}{DEEPSEEK_CALLS_END}"

    def instructions(self):
        return (f"To call functions, write {DEEPSEEK_CALLS_BEGIN}, then for each call {DEEPSEEK_CALL_BEGIN}"
                f"<function-name>{DEEPSEEK_SEP}<args-json-object>{DEEPSEEK_CALL_END}, then {DEEPSEEK_CALLS_END}.")


class KimiK2Parser(_SectionParser):
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS
    <|tool_call_end|>...<|tool_calls_section_end|>` (the call id may also be `NAME:INDEX`)."""

    marker, end = KIMI_SECTION_BEGIN, KIMI_SECTION_END
    inner_markers = (KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_ARGUMENTS_BEGIN, KIMI_CALL_END)
    _call_header = re.compile(
        rf"{re.escape(KIMI_CALL_BEGIN)}\s*(?P<name>[^<>\s]+):\d+\s*{re.escape(KIMI_ARGUMENTS_BEGIN)}")
    _call_pattern = re.compile(rf"{_call_header.pattern}(?P<arguments>.*?){re.escape(KIMI_CALL_END)}", re.S)

    def _name(self, written):
        return written.removeprefix("functions.")

    def format_calls(self, calls):
        written = "".join(f"{KIMI_CALL_BEGIN}functions.{name}:{index}{KIMI_ARGUMENTS_BEGIN}{args_text(arguments)}"
                          f"{KIMI_CALL_END}" for index, (name, arguments) in enumerate(calls))
        return f"{KIMI_SECTION_BEGIN}{written}{KIMI_SECTION_END}"

    def instructions(self):
        return (f"To call functions, write {KIMI_SECTION_BEGIN}, then for each call (numbered from 0) "
                f"{KIMI_CALL_BEGIN}functions.<function-name>:<number>{KIMI_ARGUMENTS_BEGIN}<args-json-object>"
                f"{KIMI_CALL_END}, then {KIMI_SECTION_END}.")
