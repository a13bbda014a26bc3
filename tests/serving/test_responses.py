"""/v1/responses through the real `openai` SDK against a real server: a tiny random Llama over the default
model's tokenizer. The oracle is /v1/chat/completions on the same conversation (greedy): same text, same
tool calls."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from conftest import assert_no_leak, real_tokenizer, tiny_model_for  # noqa: E402
from tiny_server import serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402
from paged_hf.serving.openai.responses_store import ResponseStore  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Rome"]}}}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
GREEDY = {"model": "tiny", "temperature": 0}


@pytest.fixture(scope="module")
def generator():
    tokenizer = real_tokenizer()
    return paged_hf.wrap(tiny_model_for(tokenizer, 1024), tokenizer, num_blocks=256, max_num_seqs=16).generator


@pytest.fixture(scope="module")
def server(generator, tmp_path_factory):
    settings = ServerSettings(responses_store_dir=str(tmp_path_factory.mktemp("responses")))
    with serving(create_app(generator, generator.tokenizer, "tiny", settings)) as url:
        yield url, settings
    assert_no_leak(generator)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(messages=messages, **{**GREEDY, **kwargs}).choices[0]


def test_plain_answer_equals_chat_completions(client):
    response = client.responses.create(input="hi there", instructions="Be brief", max_output_tokens=12, **GREEDY)
    choice = chat(client, [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "hi there"}],
                  max_tokens=12)
    assert response.output_text == choice.message.content and response.output_text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 12 and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]


def test_streamed_answer_equals_the_plain_one(client):
    plain = client.responses.create(input="a stream", max_output_tokens=10, **GREEDY)
    events = list(client.responses.create(input="a stream", max_output_tokens=10, stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert client.responses.retrieve(events[-1].response.id).output_text == text  # stored


def test_tool_call_equals_the_chat_route_s(client):
    response = client.responses.create(input="weather?", tools=[WEATHER], tool_choice="required",
                                       max_output_tokens=40, **GREEDY)
    choice = chat(client, [{"role": "user", "content": "weather?"}], tools=[CHAT_WEATHER], tool_choice="required",
                  max_tokens=40)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    assert response.status == "completed"


def test_streamed_named_tool_call(client):
    events = list(client.responses.create(input="weather?", tools=[WEATHER], max_output_tokens=40, stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"}, **GREEDY))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == arguments and json.loads(arguments)["city"] in ("Paris", "Rome")
    item = events[-1].response.output[0]
    assert events[-1].type == "response.completed" and (item.name, item.arguments) == ("get_weather", arguments)


def test_previous_response_id_keeps_tool_calls_over_three_turns(client):
    first = client.responses.create(input="weather in Rome?", instructions="Use tools", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=40, **GREEDY)
    call = first.output[-1]
    second = client.responses.create(previous_response_id=first.id, tools=[WEATHER], max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], **GREEDY)
    third = client.responses.create(previous_response_id=second.id, input="and tomorrow?", max_output_tokens=8,
                                    **GREEDY)
    assert second.previous_response_id == first.id and third.previous_response_id == second.id
    conversation = [  # instructions are not carried over (OpenAI's rule); tool calls and outputs are
        {"role": "user", "content": "weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "and tomorrow?"}]
    assert third.output_text == chat(client, conversation, max_tokens=8).message.content
    explicit = client.responses.create(input=[*[{"role": "user", "content": "weather in Rome?"}],
                                              *[item.model_dump(exclude_none=True) for item in first.output],
                                              {"type": "function_call_output", "call_id": call.call_id,
                                               "output": "sunny"}],
                                       tools=[WEATHER], max_output_tokens=8, store=False, **GREEDY)
    assert explicit.output_text == second.output_text  # the items a client sends back: the same conversation


def test_json_schema_text_format(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type":
                                                                                                       "boolean"}}}
    response = client.responses.create(input="json", max_output_tokens=30, **GREEDY, text={"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert isinstance(json.loads(response.output_text)["ok"], bool)


def test_get_delete_and_store_false(server, client):
    url = server[0]
    kept = client.responses.create(input="keep", max_output_tokens=2, **GREEDY)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    assert httpx.delete(f"{url}/v1/responses/{kept.id}").json() == {"id": kept.id, "object": "response.deleted",
                                                                     "deleted": True}
    for unknown in (kept.id, "resp_" + "0" * 32, "..%2F..%2Fetc"):
        assert httpx.get(f"{url}/v1/responses/{unknown}").status_code == 404
    unstored = client.responses.create(input="forget", max_output_tokens=2, store=False, **GREEDY)
    assert httpx.get(f"{url}/v1/responses/{unstored.id}").status_code == 404
    with pytest.raises(openai.NotFoundError, match="previous_response_id|is stored"):
        client.responses.create(input="x", previous_response_id=kept.id, max_output_tokens=2, **GREEDY)


@pytest.mark.parametrize("fields, named", [
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # (this chat template has no reasoning_effort)
    ({"reasoning": {"summary": "detailed"}}, "no summaries"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "image processor"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "encrypted"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"bogus": 1}, "bogus"),
])
def test_unsupported_fields_are_400s_naming_them(server, fields, named):
    reply = httpx.post(f"{server[0]}/v1/responses", json={"model": "tiny", "input": "hi", **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert named in error["message"] or named == error["param"], error


def test_store_stays_within_its_caps_under_10000_responses(tmp_path):
    store = ResponseStore(max_count=300, max_bytes=20_000)
    ids = [f"resp_{i:032x}" for i in range(10_000)]
    for i, response_id in enumerate(ids):
        assert store.put(response_id, {"response": {"id": response_id}, "messages": ["x" * (i % 50)]})
        assert len(store) <= 300 and store.num_bytes <= 20_000
    assert store.get(ids[-1]) is not None and store.get(ids[0]) is None
    assert not store.put(ids[0], {"big": "x" * 30_000})  # one record over max_bytes: refused, nothing evicted
    assert store.get(ids[-1]) is not None


def test_disk_store_survives_a_restart_in_lru_order(tmp_path):
    store = ResponseStore(max_count=3, max_bytes=1 << 20, directory=str(tmp_path))
    ids = [f"resp_{i:032x}" for i in range(4)]
    for response_id in ids[:3]:
        store.put(response_id, {"response": {"id": response_id}})
    assert store.get(ids[0]) is not None  # now the most recently used
    reopened = ResponseStore(max_count=3, max_bytes=1 << 20, directory=str(tmp_path))
    reopened.put(ids[3], {"response": {"id": ids[3]}})  # evicts the least recently used: ids[1]
    assert [r is not None for r in map(reopened.get, ids)] == [True, False, True, True]
    assert len(list(tmp_path.glob("*.json"))) == 3
    assert len(ResponseStore(max_count=1, directory=str(tmp_path))) == 1  # smaller caps trim on start


def test_a_restarted_server_continues_a_stored_conversation(generator, tmp_path):
    tokenizer = generator.tokenizer
    fresh = paged_hf.wrap(tiny_model_for(tokenizer, 1024), tokenizer, num_blocks=64).generator  # same weights
    settings = ServerSettings(responses_store_dir=str(tmp_path))
    with serving(create_app(fresh, tokenizer, "tiny", settings)) as url:
        first = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).responses.create(
            input="remember", max_output_tokens=4, **GREEDY)
    with serving(create_app(fresh, tokenizer, "tiny", settings)) as url:
        again = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert again.responses.retrieve(first.id).output_text == first.output_text
        follow = again.responses.create(previous_response_id=first.id, input="and?", max_output_tokens=4, **GREEDY)
        conversation = [{"role": "user", "content": "remember"}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "and?"}]
        assert follow.output_text == chat(again, conversation, max_tokens=4).message.content
    assert_no_leak(fresh)
