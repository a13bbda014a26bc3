"""/v1/messages through the real `anthropic` SDK against a real server: a tiny random Llama over the default
model's tokenizer. The oracle is /v1/chat/completions on the same conversation (greedy). This SDK has no
temperature argument any more: greedy goes in `extra_body`, as a client of this server would send it."""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from conftest import assert_no_leak, real_tokenizer, tiny_model_for  # noqa: E402
from tiny_server import serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"enum": ["Paris", "Rome"]}}}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": WEATHER["input_schema"]}}
GREEDY = {"model": "tiny", "extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server():
    tokenizer = real_tokenizer()
    generator = paged_hf.wrap(tiny_model_for(tokenizer, 1024), tokenizer, num_blocks=256, max_num_seqs=16).generator
    with serving(create_app(generator, tokenizer, "tiny", ServerSettings())) as url:
        yield url
    assert_no_leak(generator)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle(server):
    chat = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120).chat.completions

    def answer(messages, **kwargs):
        return chat.create(model="tiny", temperature=0, messages=messages, **kwargs).choices[0]
    return answer


def test_plain_answer_equals_chat_completions(client, oracle):
    message = client.messages.create(max_tokens=12, system="Be brief", **GREEDY,
                                     messages=[{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                            {"type": "text", "text": " there"}]}])
    choice = oracle([{"role": "system", "content": "Be brief"}, {"role": "user", "content": "hi there"}],
                    max_tokens=12)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice.message.content and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == "tiny"


def test_stop_sequences(client, oracle):
    text = client.messages.create(max_tokens=12, messages=[{"role": "user", "content": "go"}], **GREEDY).content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    message = client.messages.create(max_tokens=12, messages=[{"role": "user", "content": "go"}], stop_sequences=[stop],
                                     **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    expected = oracle([{"role": "user", "content": "go"}], max_tokens=12, stop=[stop]).message.content
    assert message.content[0].text == expected == text[: text.index(stop)]


def test_streamed_answer_equals_the_plain_one(client):
    plain = client.messages.create(max_tokens=10, messages=[{"role": "user", "content": "a stream"}], **GREEDY)
    events = list(client.messages.create(max_tokens=10, messages=[{"role": "user", "content": "a stream"}],
                                         stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == plain.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 10
    assert events[0].message.usage.input_tokens == plain.usage.input_tokens


def test_tool_round_trip(client, oracle):
    question = [{"role": "user", "content": "weather in Rome?"}]
    first = client.messages.create(max_tokens=40, tools=[WEATHER], tool_choice={"type": "any"}, messages=question,
                                   **GREEDY)
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    expected = oracle(question, tools=[CHAT_WEATHER], tool_choice="required", max_tokens=40).message.tool_calls
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    assert [(use.name, use.input)] == [(c.function.name, json.loads(c.function.arguments)) for c in expected]
    second = client.messages.create(max_tokens=8, tools=[WEATHER], **GREEDY, messages=[
        *question, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
    conversation = [*question, {"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]
    assert second.content[0].text == oracle(conversation, tools=[CHAT_WEATHER], max_tokens=8).message.content


def test_streamed_tool_use(client):
    kwargs = dict(max_tokens=40, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "weather?"}], **GREEDY)
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in plain.content]
    assert final.stop_reason == plain.stop_reason == "tool_use"


@pytest.mark.parametrize("fields, status, error_type, named", [
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, 400, "invalid_request_error", "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0]"),
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 100_000}, 400, "invalid_request_error", "max_tokens"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "tools"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({"model": "nope"}, 404, "not_found_error", "nope"),
    ({"bogus": 1}, 400, "invalid_request_error", "bogus"),
])
def test_errors_have_anthropic_s_shape(server, fields, status, error_type, named):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}
    reply = httpx.post(f"{server}/v1/messages", json={k: v for k, v in body.items() if v is not None})
    assert reply.status_code == status, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == error_type
    assert named in reply.json()["error"]["message"]


def test_errors_reach_the_sdk_as_its_exceptions(server, client):
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 64}, **GREEDY)
    reply = httpx.post(f"{server}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_both_sdks_on_the_default_model(loaded):
    """The issue's acceptance run on SmolLM2-135M-Instruct: Responses (plain, streamed, tool, three turns with
    previous_response_id) and Messages (plain, streamed, tool round trip), each equal to the chat route."""
    model, tokenizer = loaded
    generator = paged_hf.wrap(model, tokenizer, num_blocks=128, max_num_batched_tokens=256).generator
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with serving(create_app(generator, tokenizer, "smol", ServerSettings())) as url:
        oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

        def chat(messages, **kwargs):
            return oa.chat.completions.create(model="smol", messages=messages, temperature=0, **kwargs).choices[0]
        expected = chat(question, max_tokens=16).message.content
        assert "Paris" in expected
        greedy = {"model": "smol", "temperature": 0, "max_output_tokens": 16}
        first = oa.responses.create(input=question[0]["content"], **greedy)
        streamed = list(oa.responses.create(input=question[0]["content"], stream=True, **greedy))
        assert first.output_text == streamed[-1].response.output_text == expected
        tool = {**CHAT_WEATHER["function"], "type": "function"}
        second = oa.responses.create(previous_response_id=first.id, input="And the weather in Rome?", tools=[tool],
                                     tool_choice="required", **{**greedy, "max_output_tokens": 40})
        call = second.output[-1]
        assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
        third = oa.responses.create(previous_response_id=second.id, tools=[tool], **greedy, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        conversation = [*question, {"role": "assistant", "content": expected},
                        {"role": "user", "content": "And the weather in Rome?"},
                        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}]},
                        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
        assert third.output_text == chat(conversation, tools=[CHAT_WEATHER], max_tokens=16).message.content

        ac = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=300)
        kwargs = {"model": "smol", "max_tokens": 16, "messages": question, "extra_body": {"temperature": 0}}
        assert ac.messages.create(**kwargs).content[0].text == expected
        with ac.messages.stream(**kwargs) as stream:
            assert stream.get_final_message().content[0].text == expected
        use = ac.messages.create(**{**kwargs, "max_tokens": 40}, tools=[WEATHER], tool_choice={"type": "any"})
        use = use.content[-1]
        assert use.type == "tool_use" and use.input["city"] in ("Paris", "Rome")
        answer = ac.messages.create(**{**kwargs, "messages": [
            *question, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]},
            tools=[WEATHER])
        conversation = [*question, {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type":
                        "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                        {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]
        assert answer.content[0].text == chat(conversation, tools=[CHAT_WEATHER], max_tokens=16).message.content
    assert_no_leak(generator)
