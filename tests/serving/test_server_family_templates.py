"""An agent's two turns (tools -> the call -> the tool's result -> the answer) with the openai SDK, through a
real server whose chat template is the family's own kind (tests/templates/, written for these tests after the
published templates): hermes with Qwen3's thinking, qwen3_coder's XML and gpt-oss's harmony. The prompt the server
renders for the second turn holds the first turn's call, its thinking and the tool's result as that family writes them.

The scripted model (tests/scripted_model.py) writes a token after the prompt's last one; its tokenizer has the
end of each turn's prompt (the user's word or the tool's result, through the generation prompt) as one word,
so each turn starts its own script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from conftest import assert_no_leak  # noqa: E402
from scripted_model import scripted_model, scripted_tokenizer  # noqa: E402
from tiny_server import serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
ARGUMENTS = {"city": "Paris", "days": 3}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
QWEN3_CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
                    "3\n</parameter>\n</function>\n</tool_call>")
GPT_OSS_CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
FAMILIES = {
    "hermes": {
        "reasoning_parser": "qwen3",
        "turns": ("weather<|im_end|>\n<|im_start|>assistant\n",
                  "sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        "first": ("<think>\nI need the weather.\n</think>\n\n", HERMES_CALL),
        "second": ("<think>\nThe tool said sunny.\n</think>\n\n", "It is sunny in Paris."),
        "tools": '<tools>\n' + json.dumps(WEATHER) + '\n</tools>',
        # Qwen3's: the thinking of an answer after the last question stays; the result is a user turn
        "history": "<|im_start|>user\nweather<|im_end|>\n<|im_start|>assistant\n<think>\nI need the weather.\n</think>"
                   f"\n\n{HERMES_CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"
                   "<|im_end|>\n<|im_start|>assistant\n",
    },
    "qwen3_coder": {
        "reasoning_parser": None,
        "turns": ("weather<|im_end|>\n<|im_start|>assistant\n",
                  "sunny\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n"),
        "first": (QWEN3_CODER_CALL,),
        "second": ("It is sunny in Paris.",),
        "tools": "<function>\n<name>get_weather</name>\n<description>The weather in a city</description>\n"
                 "<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n</parameter>\n<parameter>\n"
                 '<name>days</name>\n<type>integer</type>\n</parameter>\n<required>["city"]</required>\n'
                 "</parameters>\n</function>",
        "history": "<|im_start|>user\nweather<|im_end|>\n<|im_start|>assistant\n" + QWEN3_CODER_CALL
                   + "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<|im_end|>\n"
                   "<|im_start|>assistant\n",
    },
    "openai": {  # gpt-oss's harmony (its markers plain words of this tokenizer: each turn's tail is one word)
        "reasoning_parser": "openai_gptoss", "template": "gpt_oss.jinja",
        "turns": ("weather<|end|><|start|>assistant", "sunny<|end|><|start|>assistant"),
        "first": ("<|channel|>analysis<|message|>I need the weather.", "<|end|>", GPT_OSS_CALL,
                  '{"city": "Paris", "days": 3}', "<|call|>"),
        "second": ("<|channel|>analysis<|message|>The tool said sunny.",
                   "<|end|><|start|>assistant<|channel|>final<|message|>", "It is sunny in Paris.", "<|return|>"),
        "answer": "It is sunny in Paris.",
        "tools": "## functions\n\nnamespace functions {\n\n// The weather in a city\ntype get_weather = (_: {\n"
                 "city: string,\ndays?: number,\n}) => any;\n\n} // namespace functions<|end|>",
        # the turn's analysis before its call, the call to functions.get_weather, the result from it
        "history": "<|start|>user<|message|>weather<|end|><|start|>assistant<|channel|>analysis<|message|>I need "
                   "the weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
                   '<|message|>{"city": "Paris", "days": 3}<|call|><|start|>functions.get_weather to=assistant'
                   "<|channel|>commentary<|message|>sunny<|end|><|start|>assistant",
    },
}


def chain(*words: str) -> dict[str, str]:
    return dict(zip(words, words[1:]))


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    """(family, client, the prompts the server rendered): a spy on the tokenizer's apply_chat_template."""
    name, spec = request.param, FAMILIES[request.param]
    first, second = spec["turns"]
    script = {**chain(first, *spec["first"]), **chain(second, *spec["second"])}
    template = (TEMPLATES / spec.get("template", f"{name}.jinja")).read_text()
    tokenizer = scripted_tokenizer([*script, *script.values()], template, exact=True)
    rendered, render = [], tokenizer.apply_chat_template

    def spy(*args, **kwargs):
        rendered.append(render(*args, **kwargs))
        return rendered[-1]

    tokenizer.apply_chat_template = spy
    generator = paged_hf.wrap(scripted_model(tokenizer, script), tokenizer, num_blocks=64, max_num_seqs=2).generator
    settings = ServerSettings(tool_call_parser=name, reasoning_parser=spec["reasoning_parser"])
    with serving(create_app(generator, tokenizer, "scripted", settings)) as url:
        yield name, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60), rendered
    assert_no_leak(generator)


def test_an_agents_two_turns_in_the_familys_template(family):
    name, client, rendered = family
    spec = FAMILIES[name]
    question = [{"role": "user", "content": "weather"}]
    ask = dict(model="scripted", tools=[WEATHER], max_tokens=60, temperature=0)
    first = client.chat.completions.create(messages=question, **ask).choices[0]
    (call,) = first.message.tool_calls
    assert (first.finish_reason, call.function.name, json.loads(call.function.arguments)) == (
        "tool_calls", "get_weather", ARGUMENTS)
    assert spec["tools"] in rendered[-1] and rendered[-1].endswith(spec["turns"][0])
    history = [*question, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(messages=history, **ask).choices[0]
    # (vLLM's qwen3 split leaves the newlines after </think> in the content)
    answer = spec.get("answer", "\n\nIt is sunny in Paris." if spec["reasoning_parser"] else "It is sunny in Paris.")
    assert (second.finish_reason, second.message.content, second.message.tool_calls) == ("stop", answer, None)
    assert spec["tools"] in rendered[-1] and rendered[-1].endswith(spec["history"])
    if spec["reasoning_parser"]:
        assert first.message.model_extra["reasoning"].strip() == "I need the weather."
        assert second.message.model_extra["reasoning"].strip() == "The tool said sunny."
