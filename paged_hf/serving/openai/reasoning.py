"""Reasoning parsers (`--reasoning-parser`): a thinking model's output split into its reasoning and its answer, as
vLLM's parsers of the same names split the same text (their test cases are tests/serving/test_reasoning.py's).

A whole output: `parser.split(text) -> (reasoning, content)`, each None where absent. A stream: `stream.feed(delta)
-> (reasoning delta, content delta)` per detokenized piece, then `stream.finish()` for text held back. The markers
are matched in text (a tokenizer that spells `</think>` in several tokens is served too): a delta that ends
with the beginning of a marker is held back until the next one says which it is.

- `deepseek_r1`: `<think>` ... `</think>`; the prompt may open the thinking, so text before `</think>` is
  reasoning, and an output without `</think>` is all reasoning.
- `qwen3`: the same markers; with `chat_template_kwargs: {"enable_thinking": false}` (the template closes the
  thinking in the prompt) the output is all content, and an output without `</think>` is content where thinking
  is off. (vLLM's lookahead that ends the thinking at a `<tool_call>` without `</think>` is not done here.)
- `mistral`: `[THINK]` ... `[/THINK]`; without `[THINK]` the output is content.
- `granite`: "Here is my thought process:" ... "Here is my response:" (or "Here's"); anything else is content.
- `openai_gptoss`: gpt-oss's harmony channels (harmony.py): `analysis` is the thinking, `final` the answer.
- `auto`: picked from the chat template's markers, where it names one.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from paged_hf.serving.openai import harmony

NAMES = ("deepseek_r1", "qwen3", "mistral", "granite", "openai_gptoss")
PARSER_NAMES = ("auto", *NAMES)  # what --reasoning-parser accepts


class ReasoningParser:
    """Splits a whole output, and makes a stream splitter. `prompt_ends_thinking`: the rendered prompt already
    closed the thinking (a template's switch), so the output is all content."""

    name = ""
    end = ""  # the marker that ends the thinking
    # the thinking always comes first and ends with `end`: the engine can hold a grammar until after it, and
    # close a thinking that runs past its budget (else a grammar holds from the first token: no thinking)
    thinks_first = False
    thinks_optionally = False  # an output may open with `start` (then it thinks until `end`), or answer at once
    # the marker that opens the answer wherever a thinking came before it or none did (harmony's final channel):
    # the engine holds a grammar until after it (no budget: closing a thinking is more than this marker)
    answer_marker = ""
    markers: tuple[str, ...] = ()  # what a stream holds back the beginnings of; kept in the text if special

    def __init__(self, prompt_ends_thinking: bool = False):
        self.prompt_ends_thinking = prompt_ends_thinking

    def split(self, text: str) -> tuple[str | None, str | None]:
        if self.prompt_ends_thinking:
            return None, text
        return self._split(text)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def _split(self, text: str) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def delta(self, previous: str, delta: str) -> tuple[str | None, str | None]:
        """The reasoning and content of `delta`, given everything before it (`previous`)."""
        raise NotImplementedError

    def thinking_over(self, text: str) -> bool:
        """Whether `text` holds the end of the thinking (what follows it is the answer)."""
        return self.end in text


class ThinkTags(ReasoningParser):
    """`<think>` ... `</think>` (deepseek_r1; qwen3 below)."""

    name, start, end = "deepseek_r1", "<think>", "</think>"
    markers = ("<think>", "</think>")
    thinks_first = True

    def _split(self, text):
        before, found, after = text.partition(self.start)
        text = after if found else before
        if self.end not in text:
            return self._without_end(text)
        reasoning, _, content = text.partition(self.end)
        return reasoning, content or None

    def _without_end(self, text):
        return text, None

    def delta(self, previous, delta):
        if delta in (self.start, self.end):
            return None, None
        start_before, start_now = self.start in previous, self.start in delta
        if start_before or not start_now:  # (no start at all: the prompt opened the thinking)
            if self.end in delta:
                reasoning, _, content = delta.partition(self.end)
                return reasoning, content or None
            return (None, delta) if self.end in previous else (delta, None)
        _, _, rest = delta.partition(self.start)
        if self.end in rest:
            reasoning, _, content = rest.partition(self.end)
            return reasoning, content or None
        return rest or None, None  # (the start marker and any text before it are dropped, as in split)


class Qwen3(ThinkTags):
    """Qwen3's markers: the start marker is dropped wherever it is; the thinking is on unless the request turned it
    off (`thinking`: then an output without `</think>` is content)."""

    name = "qwen3"

    def __init__(self, prompt_ends_thinking: bool = False, thinking: bool = True):
        super().__init__(prompt_ends_thinking)
        self.thinking = thinking

    def _without_end(self, text):
        return (text, None) if self.thinking else (None, text)

    def delta(self, previous, delta):
        if self.start in delta:
            delta = delta[delta.find(self.start) + len(self.start):]
        if self.end in delta:
            reasoning, _, content = delta.partition(self.end)
            return reasoning or None, content or None
        if not delta:
            return None, None
        return (None, delta) if self.end in previous else (delta, None)


class Mistral(ReasoningParser):
    """`[THINK]` ... `[/THINK]`; text before `[THINK]` and after `[/THINK]` is content."""

    name, start, end = "mistral", "[THINK]", "[/THINK]"
    markers = ("[THINK]", "[/THINK]")
    thinks_optionally = True

    def _split(self, text):
        if not text:
            return None, ""
        before, found, after = text.partition(self.start)
        if found and self.end in after:
            reasoning, _, rest = after.partition(self.end)
            content = before + rest
            return reasoning, content or None
        if found:
            return after, before or None
        if self.end in before:
            head, _, tail = before.partition(self.end)
            return None, head + tail
        return None, before

    def delta(self, previous, delta):
        if delta in (self.start, self.end):
            return None, None
        current = previous + delta
        if self.start not in current:
            return None, delta.replace(self.end, "")
        if self.start in delta:  # the thinking opens in this delta
            before, _, after = delta.partition(self.start)
            reasoning, found, content = after.partition(self.end)
            return reasoning or None, (before + content) or None
        if self.end in previous:
            return None, delta
        reasoning, found, content = delta.partition(self.end)
        return reasoning or None, content or None


class Granite(ReasoningParser):
    """IBM Granite's phrases: "Here is my thought process:" ... "Here is my response:" ("Here's" too)."""

    name = "granite"
    starts = ("Here's my thought process:", "Here is my thought process:")
    responses = ("Here's my response:", "Here is my response:")
    markers = starts + responses
    pattern = re.compile(r"(?:Here's|Here is) my thought process:(.*?)(?:Here's|Here is) my response:(.*)", re.DOTALL)

    def _split(self, text):
        match = self.pattern.search(text)
        if match is None:
            return None, text
        return match.group(1), match.group(2) or None

    def thinking_over(self, text):
        return self.pattern.search(text) is not None

    def delta(self, previous, delta):
        current = previous + delta
        started = next((s for s in self.starts if current.startswith(s)), None)
        if started is None:
            return None, delta
        match = self.pattern.search(current)
        thinking_from, before = len(started), len(previous)
        if match is None:  # still thinking
            return current[max(thinking_from, before):] or None, None
        answer_from = match.start(2)
        reasoning = current[max(thinking_from, before):max(match.end(1), before)] if before < match.end(1) else None
        return reasoning or None, current[max(answer_from, before):] or None


class GptOss(ReasoningParser):
    """gpt-oss's harmony channels (harmony.py): `analysis` is the thinking, `final` (and commentary preambles) the
    answer; tool calls are the `openai` tool parser's. (The markers are special tokens: the request's text keeps
    them, as every parser's, reasoning_request.py.)"""

    name = "openai_gptoss"
    markers = harmony.MARKERS
    answer_marker = harmony.FINAL

    def _split(self, text):
        return harmony.thinking_and_answer(text)

    def delta(self, previous, delta):
        """What the new text adds to each side (a message's body only grows; a header is read once whole)."""
        before, after = harmony.thinking_and_answer(previous), harmony.thinking_and_answer(previous + delta)
        return tuple((now or "")[len(then or ""):] or None for then, now in zip(before, after))

    def thinking_over(self, text):
        return harmony.END in text or harmony.CALL in text  # (the first message, the analysis, ended)


@dataclass
class ReasoningStream:
    """One sequence's deltas split as they come; a delta's tail that may begin a marker waits for the next."""
    parser: ReasoningParser
    previous: str = ""  # what the parser has seen
    held: str = ""  # the tail held back
    reasoning: list[str] = field(default_factory=list)  # every reasoning delta so far (None: none yet)

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        if self.parser.prompt_ends_thinking:
            return None, delta or None
        text = self.held + delta
        keep = _open_marker(self.previous + text, self.parser.markers)
        ready, self.held = (text[:len(text) - keep], text[len(text) - keep:]) if keep else (text, "")
        return self._give(ready)

    def finish(self) -> tuple[str | None, str | None]:
        """The held-back tail, at the end of the sequence."""
        ready, self.held = self.held, ""
        if self.parser.prompt_ends_thinking:
            return None, ready or None
        return self._give(ready)

    def _give(self, ready: str) -> tuple[str | None, str | None]:
        if not ready:
            return None, None
        reasoning, content = self.parser.delta(self.previous, ready)
        self.previous += ready
        if reasoning:
            self.reasoning.append(reasoning)
        return reasoning or None, content or None


def _open_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` are the beginning of a marker (and not a whole one)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def parser_for(name: str | None, chat_template: str | None, prompt_text: str = "",
               template_kwargs: dict | None = None) -> ReasoningParser | None:
    """The parser `--reasoning-parser` names for one request ("auto": by the chat template's markers), told
    whether the rendered prompt (`prompt_text`: its end) already closed the thinking; None without one."""
    if name == "auto":
        name = auto_name(chat_template)
    if name is None:
        return None
    kwargs = template_kwargs or {}
    if name in ("deepseek_r1", "qwen3"):
        end = prompt_text.rfind("</think>")
        # the prompt ends with a whole thinking the template wrote (an empty one: thinking off)
        closed = end >= 0 and not prompt_text[end + len("</think>"):].strip()
        if name == "qwen3":
            return Qwen3(closed, thinking=kwargs.get("enable_thinking", True) is not False)
        return ThinkTags(closed)
    if name == "mistral":
        return Mistral()
    if name == "granite":
        return Granite()
    if name == "openai_gptoss":
        return GptOss()
    raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSER_NAMES)}")


def auto_name(chat_template: str | None) -> str | None:
    """The parser a chat template's markers name: gpt-oss's channels, Qwen3's switch, DeepSeek-R1's tags, Mistral's,
    Granite's."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "openai_gptoss"
    if "</think>" in template:
        return "qwen3" if "enable_thinking" in template else "deepseek_r1"
    if "[THINK]" in template:
        return "mistral"
    if "thought process" in template:
        return "granite"
    return None


class ReasoningOutputs:
    """One request's sequences split into reasoning and answer, whole (`split`) or as they stream (`delta`). Each
    also gives the completion as the tool-call parsers see it: the answer's text and, with `tool_ids`, the tokens
    after the thinking (a call written while thinking is not a call)."""

    def __init__(self, parser: ReasoningParser, tokenizer, tool_ids: bool = False):
        self.parser, self.tokenizer, self.tool_ids = parser, tokenizer, tool_ids
        self.streams: dict[int, ReasoningStream] = {}
        self.answers: dict[int, str] = {}  # index -> the answer's text so far
        self.reasoned: dict[int, bool] = {}  # index -> the sequence has thought
        self.thinking_ends: dict[int, int] = {}  # index -> its first token after the thinking, once written

    def split(self, completion) -> tuple[str | None, object]:
        """(reasoning, the answer as a completion) of a finished sequence."""
        reasoning, content = self.parser.split(completion.text or "")
        self.reasoned[completion.index] = reasoning is not None
        return reasoning, self._answer(completion, content or "")

    def delta(self, completion, text: str) -> tuple[str | None, str | None, object]:
        """(reasoning delta, answer delta, the answer so far as a completion) for a sequence's new text."""
        stream = self.streams.setdefault(completion.index, self.parser.stream())
        reasoning, content = stream.feed(text)
        if completion.finish_reason is not None:
            rest = stream.finish()
            reasoning, content = _joined(reasoning, rest[0]), _joined(content, rest[1])
        answer = self.answers[completion.index] = self.answers.get(completion.index, "") + (content or "")
        self.reasoned[completion.index] = bool(stream.reasoning)
        return reasoning, content, self._answer(completion, answer)

    def num_reasoning_tokens(self, completion) -> int:
        """The sequence's tokens up to the end of its thinking (usage's reasoning_tokens), after split/delta."""
        return self._answer_start(completion)

    def _answer(self, completion, text: str):
        ids = completion.token_ids[self._answer_start(completion):] if self.tool_ids else completion.token_ids
        return dataclasses.replace(completion, text=text, token_ids=ids)

    def _answer_start(self, completion) -> int:
        """Where the answer's tokens start: after the thinking's end marker; all thinking: the end; none: 0."""
        ids, index = completion.token_ids, completion.index
        if self.parser.prompt_ends_thinking or not self.reasoned.get(index):
            return 0
        start = self.thinking_ends.get(index)
        if start is None:
            if not self.parser.thinking_over(self._text(ids)):
                return len(ids)
            low, high = 1, len(ids)  # the shortest prefix that holds the end of the thinking
            while low < high:
                middle = (low + high) // 2
                low, high = (low, middle) if self.parser.thinking_over(self._text(ids[:middle])) else (middle + 1, high)
            start = self.thinking_ends[index] = low
        return start

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def request_outputs(prepared, tokenizer) -> ReasoningOutputs | None:
    """A chat request's splitter (`prepared.reasoning`: its --reasoning-parser), or None without one."""
    if prepared.reasoning is None:
        return None
    return ReasoningOutputs(prepared.reasoning, tokenizer, tool_ids=prepared.tools.kind != "none")


def _joined(first: str | None, second: str | None) -> str | None:
    return (first or "") + (second or "") or None
