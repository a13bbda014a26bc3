"""Reasoning parsers (paged_hf/serving/openai/reasoning.py) on vLLM's own cases: the same text split the same way,
whole and streamed token by token (markers whole, words and spaces apart, as a tokenizer cuts them), and
streamed in odd pieces that cut the markers, which the stream holds back until they are whole."""

from __future__ import annotations

import re

import pytest

from paged_hf.serving.openai.reasoning import GptOss, Granite, Mistral, Qwen3, ThinkTags, auto_name, parser_for

TOKENS = re.compile(r"<think>|</think>|\[THINK\]|\[/THINK\]|\s+|[^\s<\[]+|.", re.DOTALL)


def streamed(parser, pieces: list[str]) -> tuple[str | None, str | None]:
    """vLLM's reconstruction of a stream: the deltas joined, None where there were none."""
    stream, reasoning, content = parser.stream(), [], []
    for piece in pieces:
        for part, into in zip(stream.feed(piece), (reasoning, content)):
            into += [part] if part is not None else []
    for part, into in zip(stream.finish(), (reasoning, content)):
        into += [part] if part is not None else []
    return ("".join(reasoning) if reasoning else None), ("".join(content) or None)


# vLLM tests/reasoning/test_deepseekr1_reasoning_parser.py: (output, whole, streamed), each (reasoning, content)
DEEPSEEK_R1 = [
    ("This is a reasoning section</think>This is the rest", ("This is a reasoning section", "This is the rest"),
     ("This is a reasoning section", "This is the rest")),
    ("This is a reasoning section</think>", ("This is a reasoning section", None), ("This is a reasoning section", None)),
    ("This is content", ("This is content", None), ("This is content", None)),
    ("This\nThat</think>This is the rest\nThat", ("This\nThat", "This is the rest\nThat"),
     ("This\nThat", "This is the rest\nThat")),
    ("</think>This is the rest", ("", "This is the rest"), (None, "This is the rest")),
    ("<think>This is a reasoning section</think>This is the rest", ("This is a reasoning section", "This is the rest"),
     ("This is a reasoning section", "This is the rest")),
    ("<think>This is a reasoning section</think>", ("This is a reasoning section", None),
     ("This is a reasoning section", None)),
    ("<think>This\nThat</think>This is the rest\nThat", ("This\nThat", "This is the rest\nThat"),
     ("This\nThat", "This is the rest\nThat")),
    ("<think>This is a reasoning section", ("This is a reasoning section", None), ("This is a reasoning section", None)),
    ("", ("", None), (None, None)),
    ("\n<think>This is a reasoning section</think>\nThis is the rest", ("This is a reasoning section",
     "\nThis is the rest"), ("\nThis is a reasoning section", "\nThis is the rest")),
]

# vLLM tests/reasoning/test_qwen3_reasoning_parser.py (the thinking on), the same shape
QWEN3 = [
    ("This is a reasoning section</think>This is the rest", ("This is a reasoning section", "This is the rest"),
     ("This is a reasoning section", "This is the rest")),
    ("This is a reasoning section</think>", ("This is a reasoning section", None), ("This is a reasoning section", None)),
    ("<think>This is a reasoning section</think>This is the rest", ("This is a reasoning section", "This is the rest"),
     ("This is a reasoning section", "This is the rest")),
    ("This is the rest", ("This is the rest", None), ("This is the rest", None)),
    ("<think>This is a reasoning section</think>", ("This is a reasoning section", None),
     ("This is a reasoning section", None)),
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat", ("This is a reasoning\nsection",
     "This is the rest\nThat"), ("This is a reasoning\nsection", "This is the rest\nThat")),
    ("<think>This is a reasoning section", ("This is a reasoning section", None), ("This is a reasoning section", None)),
]

# vLLM's mistral parser: [THINK] opens the thinking; without it the output is content
MISTRAL = [
    ("[THINK]This is a reasoning section[/THINK]This is the rest", ("This is a reasoning section",
     "This is the rest"), ("This is a reasoning section", "This is the rest")),
    ("[THINK]This is a reasoning section[/THINK]", ("This is a reasoning section", None),
     ("This is a reasoning section", None)),
    ("[THINK]This\nThat[/THINK]This is the rest\nThat", ("This\nThat", "This is the rest\nThat"),
     ("This\nThat", "This is the rest\nThat")),
    ("[THINK]This is a reasoning section", ("This is a reasoning section", None), ("This is a reasoning section", None)),
    ("This is content", (None, "This is content"), (None, "This is content")),
    ("This is a[/THINK] section", (None, "This is a section"), (None, "This is a section")),
    ("", (None, ""), (None, None)),
]

# vLLM tests/reasoning/test_granite_reasoning_parser.py
GRANITE = [
    ("Here's my thought process:This is a reasoning section Here's my response:This is the rest",
     ("This is a reasoning section ", "This is the rest"), ("This is a reasoning section ", "This is the rest")),
    ("Here is my thought process:This is a reasoning section Here is my response:This is the rest",
     ("This is a reasoning section ", "This is the rest"), ("This is a reasoning section ", "This is the rest")),
    ("Here's my thought process:This\nThat Here's my response:This is the rest\nThat",
     ("This\nThat ", "This is the rest\nThat"), ("This\nThat ", "This is the rest\nThat")),
    ("This is content", (None, "This is content"), (None, "This is content")),
    ("Here's my thought process:This is a reasoning section Here's my response:", ("This is a reasoning section ",
     None), ("This is a reasoning section ", None)),
]

CASES = ([(ThinkTags, case) for case in DEEPSEEK_R1] + [(Qwen3, case) for case in QWEN3]
         + [(Mistral, case) for case in MISTRAL] + [(Granite, case) for case in GRANITE])


@pytest.mark.parametrize("parser_class, case", CASES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(CASES)])
def test_whole_and_streamed_token_by_token_as_vllm_splits_them(parser_class, case):
    output, whole, token_by_token = case
    assert parser_class().split(output) == whole
    assert streamed(parser_class(), TOKENS.findall(output)) == token_by_token


@pytest.mark.parametrize("parser_class, case", CASES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(CASES)])
@pytest.mark.parametrize("size", [1, 3, 5])
def test_pieces_that_cut_the_markers_add_up_to_the_whole_split(parser_class, case, size):
    """In pieces of 1, 3 or 5 characters (markers cut anywhere) the stream gives what the token-by-token stream
    gives: a partial marker waits for the rest."""
    output, _, token_by_token = case
    pieces = [output[i:i + size] for i in range(0, len(output), size)]
    reasoning, content = streamed(parser_class(), pieces)
    expected_reasoning, expected_content = token_by_token
    if parser_class is Granite or output.startswith("\n"):  # where a token boundary decides, the text is the same
        assert (reasoning or "") + (content or "") == (expected_reasoning or "") + (expected_content or "")
    else:
        assert (reasoning, content) == (expected_reasoning, expected_content)


def test_qwen3_with_thinking_off_is_all_content():
    """vLLM's enable_thinking=False cases; and a template that closed the thinking in the prompt."""
    off = Qwen3(thinking=False)
    assert off.split("This is plain content") == (None, "This is plain content")
    closed = parser_for("qwen3", None, "<|im_start|>assistant\n<think>\n\n</think>\n\n", {"enable_thinking": False})
    assert closed.split("Hi</think> there") == (None, "Hi</think> there")
    assert streamed(closed, ["Hi", "</think>", " there"]) == (None, "Hi</think> there")


def test_multi_token_deltas_of_qwen3():
    """vLLM's multi-token delta cases: the start marker never leaks into the reasoning."""
    assert streamed(Qwen3(), ["<think>This is a reasoning section", "</think>", "This is the rest"]) == (
        "This is a reasoning section", "This is the rest")
    assert streamed(Qwen3(), ["reasoning section", "</think>This is the rest"]) == (
        "reasoning section", "This is the rest")
    assert streamed(Qwen3(), ["<think>reasoning</think>"]) == ("reasoning", None)


def test_auto_picks_from_the_chat_template():
    assert auto_name("{% if enable_thinking %}<think>\n\n</think>{% endif %}") == "qwen3"
    assert auto_name("{{ '<think>' }}...{{ '</think>' }}") == "deepseek_r1"
    assert auto_name("[THINK]{{ m }}[/THINK]") == "mistral"
    assert auto_name("Here is my thought process:") == "granite"
    assert auto_name("{{ messages }}") is None and parser_for("auto", "{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        parser_for("nope", None)


# gpt-oss's harmony output (OpenAI's harmony format guide): thinking in `analysis`, the answer in `final`
HARMONY = [
    ("<|channel|>analysis<|message|>User asks a simple question.<|end|><|start|>assistant<|channel|>final<|message|>"
     "The answer is 4.<|return|>", ("User asks a simple question.", "The answer is 4.")),
    ("<|channel|>final<|message|>Hi!<|return|>", (None, "Hi!")),
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', ("Need the weather.", None)),
    ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me look."
     "<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>", ("Plan.", "Let me look.Done.")),
    ("<|channel|>analysis<|message|>Cut here", ("Cut here", None)),
]


@pytest.mark.parametrize("output, whole", HARMONY)
@pytest.mark.parametrize("size", [1, 4, 9])
def test_gpt_oss_channels_whole_and_streamed(output, whole, size):
    assert GptOss().split(output) == whole
    assert streamed(GptOss(), [output[i:i + size] for i in range(0, len(output), size)]) == whole
    assert auto_name("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "openai_gptoss"
