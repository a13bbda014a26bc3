"""gpt-oss's harmony format through a real server (`--reasoning-parser openai_gptoss --tool-call-parser openai`,
vLLM's pair) and the `openai` SDK: a scripted model (tests/scripted_model.py) writes harmony messages whose
markers are special tokens of its tokenizer, as they are of gpt-oss's; the thinking comes back as reasoning,
the final channel as the content, a commentary message to a function as a tool call, over an agent's two turns."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from conftest import assert_no_leak  # noqa: E402
from scripted_model import scripted_model, scripted_tokenizer  # noqa: E402
from tiny_server import StreamedCalls, serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402

SPECIALS = ("<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
FINAL_AFTER_THINKING = "<|end|><|start|>assistant<|channel|>final<|message|>"
# prompt word -> what follows (each token has one successor, so the two thinkings end with tokens of their own)
SCRIPT = {
    "weather": "<|channel|>", "<|channel|>": "analysis", "analysis": "<|message|>",
    "<|message|>": "Need the weather.", "Need the weather.": "<|end|>", "<|end|>": CALL_HEADER,
    CALL_HEADER: '{"city": "Paris"}', '{"city": "Paris"}': "<|call|>",
    "sunny": "<|channel|>analysis<|message|>", "<|channel|>analysis<|message|>": "The tool said sunny.",
    "The tool said sunny.": FINAL_AFTER_THINKING, FINAL_AFTER_THINKING: "It is sunny in Paris.",
    "It is sunny in Paris.": "<|return|>",
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# gpt-oss's template opens the answer with <|start|>assistant and names reasoning_effort; the last user or tool
# message's last word starts the script
TEMPLATE = ("{# <|channel|> #}{% for m in messages %}{{ m['content'] or '' }}{% endfor %}"
            "{% if reasoning_effort %}{% endif %}")


@pytest.fixture(scope="module")
def client():
    words = [*SCRIPT, *SCRIPT.values()]
    tokenizer = scripted_tokenizer(words, TEMPLATE, exact=True, specials=SPECIALS)
    generator = paged_hf.wrap(scripted_model(tokenizer, SCRIPT), tokenizer, num_blocks=32, max_num_seqs=2).generator
    settings = ServerSettings(tool_call_parser="openai", reasoning_parser="auto")  # auto: the template's channels
    with serving(create_app(generator, tokenizer, "gpt-oss", settings)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert_no_leak(generator)


def chat(client, messages, **fields):
    return client.chat.completions.create(model="gpt-oss", messages=messages, tools=[WEATHER],
                                          **{"max_tokens": 12, "temperature": 0, "reasoning_effort": "low", **fields})


def streamed(client, messages, **fields) -> tuple[str, str, list, str | None]:
    reasoning, content, calls, finish = "", "", StreamedCalls(), None
    for chunk in chat(client, messages, stream=True, **fields):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            content += c.delta.content or ""
            calls.add(c.delta.tool_calls)
            finish = c.finish_reason or finish
    return reasoning, content, [(name, json.loads(arguments)) for name, arguments in calls.joined()], finish


def test_an_agents_two_turns(client):
    """Turn 1: think, call get_weather. Turn 2, with the tool's result: think, answer in the final channel."""
    question = [{"role": "user", "content": "weather"}]
    first = chat(client, question).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert first.message.model_extra["reasoning"] == "Need the weather."
    (call,) = first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert streamed(client, question) == ("Need the weather.", "", [("get_weather", {"city": "Paris"})],
                                          "tool_calls")
    history = [*question, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = chat(client, history).choices[0]
    assert second.finish_reason == "stop" and second.message.tool_calls is None
    assert (second.message.model_extra["reasoning"], second.message.content) == (
        "The tool said sunny.", "It is sunny in Paris.")
    assert streamed(client, history) == ("The tool said sunny.", "It is sunny in Paris.", [], "stop")


def test_the_responses_api_gets_a_reasoning_item_and_the_answer(client):
    response = client.responses.create(model="gpt-oss", input="sunny", max_output_tokens=12, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "The tool said sunny."
    assert response.output_text == "It is sunny in Paris."


def test_the_openai_tool_parser_needs_the_reasoning_parser():
    with pytest.raises(ValueError, match="needs --reasoning-parser openai_gptoss"):
        ServerSettings(tool_call_parser="openai")



def test_output_cut_by_max_tokens_is_never_an_error(client):
    """A thinking cut short is the reasoning; a call cut before its <|call|> is no call, finish_reason "length".
    Streamed, what went out before the cut stays out (its arguments as the model wrote them)."""
    question = [{"role": "user", "content": "weather"}]
    for cut, sent in ((4, []), (6, []), (7, [("get_weather", '{"city": "Paris"}')])):
        choice = chat(client, question, max_tokens=cut).choices[0]
        assert (choice.finish_reason, choice.message.model_extra["reasoning"], choice.message.content,
                choice.message.tool_calls) == ("length", "Need the weather.", None, None)
        reasoning, content, calls, finish = "", "", StreamedCalls(), None
        for chunk in chat(client, question, max_tokens=cut, stream=True):
            for c in chunk.choices:
                reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
                content += c.delta.content or ""
                calls.add(c.delta.tool_calls)
                finish = c.finish_reason or finish
        assert (reasoning, content, calls.joined(), finish) == ("Need the weather.", "", sent, "length")
