"""response_format, structured_outputs and tools through the server and the real `openai` client: a tiny
random Llama with the default model's tokenizer, so only the grammar makes its output valid."""

from __future__ import annotations

import enum
import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

from conftest import assert_no_leak, real_tokenizer, tiny_model_for  # noqa: E402
from tiny_server import StreamedCalls, serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402
from paged_hf.serving.openai.chat_template import chat_prompt_ids  # noqa: E402
from paged_hf.serving.openai.protocol import ChatCompletionRequest  # noqa: E402
from paged_hf.serving.openai.tool_calls import tool_mode  # noqa: E402


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Size(BaseModel):
    width: int = Field(ge=0, le=9)
    unit: Color


class Item(BaseModel):
    color: Color
    ok: bool
    size: Size
    tags: list[Color] = Field(max_length=2)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server():
    tokenizer = real_tokenizer()
    model = tiny_model_for(tokenizer, 1024)
    generator = paged_hf.wrap(model, tokenizer, num_blocks=256, max_num_seqs=16).generator
    with serving(create_app(generator, tokenizer, "tiny", ServerSettings())) as url:
        yield url, tokenizer
    assert_no_leak(generator)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 60, **kwargs}
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **kwargs)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "an item"}],
                                               response_format=Item, max_tokens=80, n=2, temperature=1.0, seed=3)
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Item), choice.message.content


def test_stream_with_a_pydantic_model(client):
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "an item"}],
                                        response_format=Item, max_tokens=80, temperature=0) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Item)


def test_json_object_and_structured_outputs_field(client):
    reply = chat(client, response_format={"type": "json_object"}, max_tokens=8)
    assert reply.choices[0].message.content.startswith("{")
    reply = chat(client, extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert reply.choices[0].message.content in ("left", "right")
    completion = client.completions.create(model="tiny", prompt="code:", max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})
    assert len(completion.choices[0].text) == 4 and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     'Unsupported type "strin"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "[a-"}}, "Unclosed"),
    ({"structured_outputs": {"regexp": "a"}}, "regexp"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "not both"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"choice": ["a"]}}, "own schema"),
])
def test_bad_requests_are_400_naming_the_problem(server, body, message):
    response = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_named_tool_choice_is_enforced(client):
    reply = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert call.id.startswith("call_")


def test_required_tool_choice_streams_like_the_whole(client):
    whole = chat(client, tools=[WEATHER, TIME], tool_choice="required", seed=1)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and calls
    assert all(c.function.name in ("get_weather", "get_time") for c in calls)
    stream = chat(client, tools=[WEATHER, TIME], tool_choice="required", seed=1, stream=True)
    streamed, finish, pieces = {}, None, 0
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
                pieces += bool(delta.function.arguments)
    assert finish == "tool_calls"
    assert [(e["name"], e["arguments"]) for _, e in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert pieces > len(calls)  # the arguments as the model writes them, not each call whole at the end


def test_auto_finds_hermes_calls_streamed_and_not(client):
    """tool_choice auto: the parser finds the call the model writes (a regex makes this model write one)."""
    force = {"structured_outputs": {"regex": r'Sure\.<tool_call>\{"name": "get_weather", "arguments": '
                                             r'\{"city": "(Paris|Rome)"\}\}</tool_call>'}}
    reply = chat(client, tools=[WEATHER], extra_body=force)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    content, calls, finish = "", StreamedCalls(), None
    for chunk in chat(client, tools=[WEATHER], extra_body=force, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls.add(c.delta.tool_calls)
            finish = c.finish_reason or finish
    whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert (content, calls.joined(), finish) == ("Sure.", whole, "tool_calls")


def test_tools_and_tool_messages_reach_the_template(server):
    """This template has no tools: they come in a system message, earlier calls and results as text."""
    request = ChatCompletionRequest(model="tiny", tools=[WEATHER], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    text = server[1].decode(chat_prompt_ids(request, server[1], tool_mode(request)))
    assert '"name": "get_weather"' in text and "<tools>" in text and "sunny" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text


def test_langchain_structured_output_and_tool_call(server):
    """LangChain's ChatOpenAI: with_structured_output (json_schema, strict) and bind_tools with a forced tool."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server[0] + "/v1", api_key="none", model="tiny", temperature=0,
                                      max_tokens=80, max_retries=0)
    assert isinstance(llm.with_structured_output(Item).invoke("an item, please"), Item)

    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # a random model writes short args only if asked
        """The weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome")
