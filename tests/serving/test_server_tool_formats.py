"""Every --tool-call-parser through a real server and the `openai` SDK: a scripted model (tests/scripted_model.py)
writes a call in the format's exact text (the examples of vLLM's parser tests) over several tokens, and the
client gets it back as OpenAI's `tool_calls`, whole and streamed (the arguments as the model writes them, as
far as they are final); a thinking model's call after its thinking too; an agent's two turns (the call, the
tool's result, the answer); and two calls, one of several arguments, streamed on chat completions, Responses and
Messages alike."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from conftest import assert_no_leak  # noqa: E402
from scripted_model import scripted_model, scripted_tokenizer  # noqa: E402
from tiny_server import StreamedCalls, serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402
from paged_hf.serving.openai.tool_parsers import PARSERS  # noqa: E402
from paged_hf.serving.openai.tool_formats.special_tokens import (  # noqa: E402
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
)

PARIS = {"city": "Paris"}
# each format's text for get_weather(city="Paris"), as its models write it
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "pythonic": "[get_weather(city='Paris')]",
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                   "</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "deepseek_v3": f"{DEEPSEEK_CALLS_BEGIN}{DEEPSEEK_CALL_BEGIN}function{DEEPSEEK_SEP}get_weather\n```json\n"
                   f'{{"city": "Paris"}}\n```{DEEPSEEK_CALL_END}{DEEPSEEK_CALLS_END}',
    "deepseek_v31": f'{DEEPSEEK_CALLS_BEGIN}{DEEPSEEK_CALL_BEGIN}get_weather{DEEPSEEK_SEP}{{"city": "Paris"}}'
                    f"{DEEPSEEK_CALL_END}{DEEPSEEK_CALLS_END}",
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
               '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
}
# formats whose calls follow the content: the model says something first
CONTENT_FIRST = ("hermes", "mistral", "qwen3_coder", "glm45", "deepseek_v3", "deepseek_v31", "kimi_k2")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt ends with the user's last word



def pieces(text: str, size: int = 6) -> list[str]:
    """`text` cut into tokens of about `size` characters, each one different (a token has one successor)."""
    cut = [text[i:i + size] for i in range(0, len(text), size)]
    while len(set(cut)) < len(cut):
        i = next(i for i in range(1, len(cut)) if cut[i] in cut[:i])
        cut[i - 1:i + 1] = [cut[i - 1] + cut[i]]
    return cut


def script_for(name: str) -> tuple[list[str], dict[str, str]]:
    """The words and the script that make the model answer the prompt word `name` in that format, its call
    written over several tokens (after "Sure." where the format allows content first), `think-NAME` with a
    thinking before it, and the tool's result `sunny` with the final answer."""
    call, sure, think = pieces(CALLS[name]), f"Sure ({name}).", f"think-{name}"
    script = {name: sure if name in CONTENT_FIRST else call[0], think: "[THINK]", "[THINK]": "I need the weather.",
              "I need the weather.": "[/THINK]", "[/THINK]": call[0], sure: call[0],
              "sunny": "It is sunny in Paris.", "answer": "sunny", **dict(zip(call, call[1:]))}
    return [name, think, sure, *call, "[THINK]", "I need the weather.", "[/THINK]", "sunny",
            "It is sunny in Paris.", "answer"], script


@pytest.fixture(params=sorted(CALLS))
def format_client(request):
    name = request.param
    words, script = script_for(name)
    tokenizer = scripted_tokenizer(words, TEMPLATE, exact=True, specials=("[THINK]", "[/THINK]"))  # (Magistral's)
    assert tokenizer.decode(tokenizer(CALLS[name])["input_ids"]) == CALLS[name]  # written as is
    generator = paged_hf.wrap(scripted_model(tokenizer, script), tokenizer, num_blocks=32, max_num_seqs=2).generator
    settings = ServerSettings(tool_call_parser=name, reasoning_parser="mistral")  # (its thinking is optional)
    with serving(create_app(generator, tokenizer, "scripted", settings)) as url:
        yield name, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert_no_leak(generator)


def ask(client, word: str, **fields):
    return client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": word}],
                                          tools=[WEATHER], **{"max_tokens": 40, "temperature": 0, **fields})


def test_the_format_comes_back_as_tool_calls_whole_and_streamed(format_client):
    name, client = format_client
    choice = ask(client, name).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", PARIS)]
    assert choice.message.content == (f"Sure ({name})." if name in CONTENT_FIRST else None)
    content, calls, finish, argument_deltas = "", StreamedCalls(), None, 0
    for chunk in ask(client, name, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls.add(c.delta.tool_calls)
            argument_deltas += sum(bool(d.function.arguments) for d in c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert (content or None, calls.joined(), finish) == (choice.message.content, whole, "tool_calls")
    assert argument_deltas > 1  # as the model writes them, not whole at the end


def test_a_call_after_the_thinking(format_client):
    """A reasoning parser first (mistral's [THINK] ... [/THINK]): the thinking is reasoning, the call after it is
    found."""
    name, client = format_client
    message = ask(client, f"think-{name}").choices[0].message
    assert message.model_extra["reasoning"] == "I need the weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", PARIS)]


def test_a_grammar_holds_after_an_optional_thinking(format_client):
    """mistral's [THINK] is optional: opened, the model thinks freely and then answers in the grammar; not
    opened, the grammar holds from the first token."""
    name, client = format_client
    sunny = {"structured_outputs": {"choice": ["sunny"]}}
    thought = ask(client, f"think-{name}", extra_body=sunny).choices[0].message
    assert (thought.model_extra["reasoning"], thought.content) == ("I need the weather.", "sunny")
    direct = ask(client, "answer", extra_body=sunny).choices[0].message  # (a prompt it answers at once)
    assert (direct.model_extra.get("reasoning"), direct.content) == (None, "sunny")


def test_without_tools_the_call_is_text(format_client):
    name, client = format_client
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": name}],
                                           max_tokens=40, temperature=0)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content.endswith(CALLS[name]) and reply.choices[0].finish_reason == "stop"


def test_an_agents_two_turns(format_client):
    """The call, the tool's result in a tool message, then the answer: the conversation an agent runs."""
    name, client = format_client
    question = [{"role": "user", "content": name}]
    first = ask(client, question[0]["content"]).choices[0].message
    (call,) = first.tool_calls
    history = [*question, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model="scripted", messages=history, tools=[WEATHER], max_tokens=40,
                                            temperature=0).choices[0]
    assert (answer.finish_reason, answer.message.content, answer.message.tool_calls) == (
        "stop", "It is sunny in Paris.", None)


def test_output_cut_by_max_tokens_is_content(format_client):
    """A call cut short is no call: its text comes back as content, whole and streamed, finish_reason "length"
    (vLLM's reading); a thinking cut short is the reasoning (mistral's [THINK] opened and never closed)."""
    name, client = format_client
    cut = 4  # ("Sure (...)." and) the call's first tokens: none is written whole in fewer than 5
    choice = ask(client, name, max_tokens=cut).choices[0]
    _, script = script_for(name)
    written, word = [], name
    for _ in range(cut):
        word = script[word]
        written.append(word)
    assert (choice.finish_reason, choice.message.tool_calls, choice.message.content) == ("length", None,
                                                                                          "".join(written))
    content, finish = "", None
    for chunk in ask(client, name, max_tokens=cut, stream=True):
        for c in chunk.choices:
            content, finish = content + (c.delta.content or ""), c.finish_reason or finish
    assert (content, finish) == (choice.message.content, "length")
    thinking = ask(client, f"think-{name}", max_tokens=2).choices[0]
    assert (thinking.finish_reason, thinking.message.model_extra["reasoning"], thinking.message.content,
            thinking.message.tool_calls) == ("length", "I need the weather.", None, None)


# two calls, the first of several arguments (`days` an integer: qwen3_coder types it by the schema)
FORECAST = {"city": "Paris", "days": 3, "unit": "celsius"}
MULTI = [("get_weather", FORECAST), ("get_time", {})]
MULTI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string"}}}}},
               {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture(params=sorted(CALLS))
def multi_client(request):
    """A server whose model answers `calls` with MULTI in the format (after "Both." where content comes first)."""
    name = request.param
    call, both = pieces(PARSERS[name].format_calls(MULTI)), f"Both ({name})."
    script = {"calls": both if name in CONTENT_FIRST else call[0], both: call[0], **dict(zip(call, call[1:]))}
    tokenizer = scripted_tokenizer(["calls", both, *call], TEMPLATE, exact=True)
    generator = paged_hf.wrap(scripted_model(tokenizer, script), tokenizer, num_blocks=32, max_num_seqs=2).generator
    with serving(create_app(generator, tokenizer, "scripted", ServerSettings(tool_call_parser=name))) as url:
        yield name, url
    assert_no_leak(generator)


def test_several_calls_stream_argument_by_argument_on_every_route(multi_client):
    """The joined deltas are the whole answer's arguments exactly, the call of several arguments in several
    deltas, on chat completions, Responses (function_call_arguments.delta) and Messages (input_json_delta)."""
    name, url = multi_client
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    ask_calls = dict(model="scripted", messages=[{"role": "user", "content": "calls"}], tools=MULTI_TOOLS,
                     max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**ask_calls).choices[0].message
    written = [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert [(n, json.loads(a)) for n, a in written] == MULTI
    calls, deltas = StreamedCalls(), {}
    for chunk in client.chat.completions.create(**ask_calls, stream=True):
        for c in chunk.choices:
            calls.add(c.delta.tool_calls)
            for d in c.delta.tool_calls or []:
                deltas[d.index] = deltas.get(d.index, 0) + bool(d.function.arguments)
    assert calls.joined() == written and deltas[0] > 2
    assert responses_arguments(client, name) == (written, True)
    assert messages_inputs(url) == ([(n, json.loads(a)) for n, a in written], True)


def responses_arguments(client, name: str) -> tuple[list[tuple[str, str]], bool]:
    """The streamed function calls (name, joined argument deltas), checked against the response's items; and
    whether the first came in more than two deltas."""
    tools = [{"type": "function", **t["function"]} for t in MULTI_TOOLS]
    events = list(client.responses.create(model="scripted", input="calls", tools=tools, max_output_tokens=120,
                                          temperature=0, stream=True))
    joined, counts = {}, {}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            joined[event.output_index] = joined.get(event.output_index, "") + event.delta
            counts[event.output_index] = counts.get(event.output_index, 0) + 1
    items = [(i, item) for i, item in enumerate(events[-1].response.output) if item.type == "function_call"]
    assert [item.arguments for _, item in items] == [joined.get(i, "") for i, _ in items]
    return [(item.name, item.arguments) for _, item in items], counts.get(items[0][0], 0) > 2


def messages_inputs(url: str) -> tuple[list[tuple[str, dict]], bool]:
    """The streamed tool_use blocks (name, joined input_json_delta read as JSON), checked against the blocks of
    the same request unstreamed; and whether the first came in more than two deltas."""
    anthropic = pytest.importorskip("anthropic")
    sdk = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    ask = dict(model="scripted", max_tokens=120, messages=[{"role": "user", "content": "calls"}],
               tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                      for t in MULTI_TOOLS], extra_body={"temperature": 0})
    names, joined, counts = {}, {}, {}
    for event in sdk.messages.create(**ask, stream=True):
        if event.type == "content_block_start" and event.content_block.type == "tool_use":
            names[event.index], joined[event.index], counts[event.index] = event.content_block.name, "", 0
        elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            joined[event.index] += event.delta.partial_json
            counts[event.index] += bool(event.delta.partial_json)
    streamed = [(names[i], json.loads(joined[i] or "{}")) for i in sorted(names)]
    assert streamed == [(b.name, b.input) for b in sdk.messages.create(**ask).content if b.type == "tool_use"]
    return streamed, counts[min(counts)] > 2
