"""OpenAI's harmony format (gpt-oss), read from the output's text with its special tokens kept.

An output is messages: `<|start|>assistant` (the first one's is in the prompt), a header (`<|channel|>analysis`,
`<|channel|>final`, `<|channel|>commentary`, a recipient ` to=functions.NAME`, a `<|constrain|>json`), then
`<|message|>`, the body, and `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the answer is done). The
`analysis` channel is the thinking, `final` the answer, `commentary` with a recipient a tool call (without one,
a preamble the user sees). Used by the `openai_gptoss` reasoning parser and the `openai` tool-call parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
FINAL = f"{CHANNEL}final{MESSAGE}"  # what opens the answer (a grammar holds from after it)
_BODY_END = re.compile("|".join(re.escape(marker) for marker in (END, CALL, RETURN)))
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None  # "functions.NAME" for a tool call
    body: str
    complete: bool  # its end marker is written

    @property
    def is_thinking(self) -> bool:
        return self.channel == "analysis" and self.recipient is None

    @property
    def is_answer(self) -> bool:
        """The final channel, and a commentary preamble (no recipient): text for the user."""
        return self.recipient is None and self.channel in ("final", "commentary")


def messages(text: str) -> list[HarmonyMessage]:
    """The messages of `text` whose header is written (a header still open is left out: it may grow)."""
    found = []
    for part in text.split(START):
        header, opened, rest = part.partition(MESSAGE)
        if not opened:
            continue
        end = _BODY_END.search(rest)
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        found.append(HarmonyMessage(channel and channel[1], recipient and recipient[1],
                                    rest[:end.start()] if end else rest, end is not None))
    return found


def thinking_and_answer(text: str) -> tuple[str | None, str | None]:
    """(the analysis messages' text, the answer messages' text), each None where there is none."""
    found = messages(text)
    thinking = [m.body for m in found if m.is_thinking]
    answer = [m.body for m in found if m.is_answer]
    return ("".join(thinking) if thinking else None), ("".join(answer) if answer else None)


def tool_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments text) of each message to a function; None if one of them is not written whole."""
    calls = []
    for message in messages(text):
        if message.recipient is None or not message.recipient.startswith("functions."):
            continue
        if not message.complete:
            return None
        calls.append((message.recipient.removeprefix("functions."), message.body.strip()))
    return calls


def call_text(name: str, arguments: str) -> str:
    """One tool call as gpt-oss writes it."""
    return f"{START}assistant{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{arguments}{CALL}"
