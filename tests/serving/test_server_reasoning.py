"""--reasoning-parser through the server and the real `openai` client: a scripted model (a Llama whose weights
make each token follow from the one before, so it writes a thinking model's output: `<think> ... </think>` and
a hermes tool call) answers chat requests; the thinking comes back as `reasoning` (and `reasoning_content`),
whole and streamed, apart from the content and the tool calls."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from conftest import assert_no_leak  # noqa: E402
from scripted_model import scripted_model, scripted_tokenizer  # noqa: E402
from tiny_server import StreamedCalls, serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402
from paged_hf.serving.openai.chat_template import chat_prompt_ids  # noqa: E402
from paged_hf.serving.openai.protocol import ChatCompletionRequest  # noqa: E402

CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
# what the model writes after each token (the prompt's last token starts it); every other token: </s>
SCRIPT = {"weather": "<think>", "<think>": "need", "need": "city", "city": "</think>", "</think>": "<tool_call>",
          "<tool_call>": CALL, CALL: "</tool_call>", "hello": "it", "it": "is", "is": "sunny"}
WORDS = ["<user>", "<assistant>", "<system>", "<tool_call>", "</tool_call>", "<think>", "</think>", CALL, "need",
         "city", "weather", "hello", "it", "is", "sunny", "low", '"Paris"']
# DeepSeek-R1's kind of template: earlier answers without their thinking; the prompt ends with the user's words
DEEPSEEK_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ (m['content'] or '').split('</think>')[-1] }} "
                     "{% endfor %}")
# Qwen3's kind: `enable_thinking: false` closes an empty thinking at the end of the prompt
QWEN3_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% if m.reasoning_content %}"
                  "{{ m.reasoning_content }} {% endif %}{% endfor %}"
                  "{% if enable_thinking is defined and not enable_thinking %}<think> </think>{% endif %}"
                  "{% if reasoning_effort %}{{ reasoning_effort }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server():
    tokenizer = scripted_tokenizer(WORDS, DEEPSEEK_TEMPLATE)
    generator = paged_hf.wrap(scripted_model(tokenizer, SCRIPT), tokenizer, num_blocks=64, max_num_seqs=4).generator
    settings = ServerSettings(reasoning_parser="auto", trust_request_chat_template=True)
    with serving(create_app(generator, tokenizer, "scripted", settings)) as url:
        yield url, tokenizer
    assert_no_leak(generator)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(client, word: str, **fields):
    return client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": word}],
                                          **{"max_tokens": 20, "temperature": 0, **fields})


def streamed(client, word: str, **fields) -> dict:
    """The deltas joined: reasoning, reasoning_content, content, tool call names and arguments, finish reason."""
    joined, calls = {"reasoning": "", "reasoning_content": "", "content": "", "finish": None}, StreamedCalls()
    for chunk in ask(client, word, stream=True, **fields):
        for choice in chunk.choices:
            delta = choice.delta
            for name in ("reasoning", "reasoning_content"):
                joined[name] += (delta.model_extra or {}).get(name) or ""
            joined["content"] += delta.content or ""
            calls.add(delta.tool_calls)
            joined["finish"] = choice.finish_reason or joined["finish"]
    return {**joined, "calls": calls.joined()}


def test_the_thinking_comes_back_as_reasoning_whole_and_streamed(client):
    """deepseek_r1 (the template's markers): `<think> need city </think>` is the reasoning, the rest the content."""
    choice = ask(client, "weather").choices[0]
    message = choice.message
    assert message.model_extra["reasoning"] == " need city "
    assert message.model_extra["reasoning_content"] == " need city "
    assert message.content == f" <tool_call> {CALL} </tool_call>"
    assert choice.finish_reason == "stop"
    whole = ask(client, "weather")
    assert whole.usage.completion_tokens_details.reasoning_tokens == 4  # <think> need city </think>
    assert whole.usage.completion_tokens == 8  # and <tool_call> CALL </tool_call> </s>
    last = list(ask(client, "weather", stream=True, stream_options={"include_usage": True}))[-1]
    assert last.usage.completion_tokens_details.reasoning_tokens == 4
    assert streamed(client, "weather") == {"reasoning": " need city ", "reasoning_content": " need city ",
                                           "content": message.content, "calls": [], "finish": "stop"}


def test_a_tool_call_after_the_thinking(client):
    """With tools, the call is found in the answer; the thinking stays reasoning."""
    choice = ask(client, "weather", tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == " need city "
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Paris"}')  # as written
    assert streamed(client, "weather", tools=[WEATHER]) == {
        "reasoning": " need city ", "reasoning_content": " need city ", "content": "",
        "calls": [("get_weather", '{"city":"Paris"}')], "finish": "tool_calls"}


def test_include_reasoning_false_leaves_it_out(client):
    choice = ask(client, "weather", extra_body={"include_reasoning": False}).choices[0]
    assert choice.message.model_extra.get("reasoning") is None
    assert choice.message.content == f" <tool_call> {CALL} </tool_call>"
    joined = streamed(client, "weather", extra_body={"include_reasoning": False})
    assert (joined["reasoning"], joined["content"]) == ("", choice.message.content)


def test_without_the_end_marker_deepseek_r1_reads_it_all_as_thinking(client):
    """DeepSeek-R1's templates open the thinking in the prompt, so an output that never closes it is thinking."""
    message = ask(client, "hello").choices[0].message
    assert (message.model_extra["reasoning"], message.content) == ("it is sunny", None)


def test_output_cut_by_max_tokens_is_never_an_error(client):
    """A thinking cut short is reasoning; a hermes call cut before its JSON is the content; both "length"."""
    cut_thinking = ask(client, "weather", max_tokens=2).choices[0]
    assert (cut_thinking.finish_reason, cut_thinking.message.model_extra["reasoning"],
            cut_thinking.message.content) == ("length", " need", None)
    assert streamed(client, "weather", max_tokens=2) == {"reasoning": " need", "reasoning_content": " need",
                                                         "content": "", "calls": [], "finish": "length"}
    cut_call = ask(client, "weather", tools=[WEATHER], max_tokens=5).choices[0]
    assert (cut_call.finish_reason, cut_call.message.content, cut_call.message.tool_calls) == (
        "length", " <tool_call>", None)
    assert streamed(client, "weather", tools=[WEATHER], max_tokens=5) == {
        "reasoning": " need city ", "reasoning_content": " need city ", "content": " <tool_call>", "calls": [],
        "finish": "length"}


def test_qwen3_with_the_thinking_off_is_all_content(client):
    """A template with `enable_thinking` is Qwen3's; turned off, the prompt ends with a closed thinking and
    the model's `</think>` after it is content."""
    off = {"chat_template": QWEN3_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}}
    message = ask(client, "weather", extra_body=off).choices[0].message
    assert message.model_extra.get("reasoning") is None
    assert message.content == f"<tool_call> {CALL} </tool_call>"
    on = ask(client, "weather", extra_body={"chat_template": QWEN3_TEMPLATE}).choices[0].message
    assert (on.model_extra["reasoning"], on.content) == (" need city ", f" <tool_call> {CALL} </tool_call>")


def test_the_grammar_holds_after_the_thinking(client):
    """The thinking is free, the answer follows the grammar (a JSON schema: a city, one token of this vocabulary)."""
    schema = {"type": "string", "enum": ["Paris", "Rome"]}
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}}
    message = ask(client, "weather", **fields).choices[0].message
    assert message.model_extra["reasoning"] == " need city "
    assert json.loads(message.content) in ("Paris", "Rome")
    joined = streamed(client, "weather", **fields)
    assert (joined["reasoning"], joined["content"]) == (" need city ", message.content)
    choice = ask(client, "weather", extra_body={"structured_outputs": {"choice": ["sunny"]}}).choices[0].message
    assert (choice.model_extra["reasoning"], choice.content) == (" need city ", " sunny")


def test_the_thinking_budget_closes_the_thinking(client):
    """A budget of 2: `<think> need`, then the engine writes `</think>` and the answer follows."""
    choice = ask(client, "weather", extra_body={"thinking_token_budget": 2}).choices[0]
    assert choice.message.model_extra["reasoning"] == " need "
    assert choice.message.content == f" <tool_call> {CALL} </tool_call>" and choice.finish_reason == "stop"


def test_where_the_thinking_may_not_come_first_a_grammar_holds_from_the_first_token(server, client):
    """mistral's [THINK] where the tokenizer has no such token (the engine cannot follow the thinking): with a
    grammar the whole output is the answer; a budget is a 400. (A tokenizer with the token: the tool-format
    tests.)"""
    mistral = {"chat_template": "{# [THINK] [/THINK] #}{% for m in messages %}{{ m['content'] }} {% endfor %}"}
    message = ask(client, "hello", extra_body={**mistral, "structured_outputs": {"choice": ["sunny"]}}
                  ).choices[0].message
    assert (message.model_extra.get("reasoning"), message.content) == (None, "sunny")
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json={
        "model": "scripted", "messages": [{"role": "user", "content": "weather"}], "thinking_token_budget": 4,
        **mistral})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text


def test_reasoning_effort_reaches_a_template_that_reads_it(server):
    """...and is a 400 where the template has no such setting (it would change nothing)."""
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json={
        "model": "scripted", "messages": [{"role": "user", "content": "weather"}], "reasoning_effort": "low"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    request = ChatCompletionRequest(model="scripted", messages=[{"role": "user", "content": "hello"}],
                                    reasoning_effort="low")
    assert server[1].decode(chat_prompt_ids(request, server[1], chat_template=QWEN3_TEMPLATE)).endswith("hello low")


def test_an_earlier_answers_reasoning_reaches_the_template_as_reasoning_content(server):
    request = ChatCompletionRequest(model="scripted", messages=[
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "sunny", "reasoning": "need city"},
        {"role": "user", "content": "weather"}])
    prompt = server[1].decode(chat_prompt_ids(request, server[1], chat_template=QWEN3_TEMPLATE))
    assert "<assistant> sunny need city <user> weather" in prompt


def test_an_unknown_parser_is_refused_at_start():
    with pytest.raises(ValueError, match="--reasoning-parser 'nope': choose one of auto, deepseek_r1"):
        ServerSettings(reasoning_parser="nope")


# --- the other APIs: Responses' reasoning items, Anthropic's thinking blocks ---------------------------------

def test_responses_give_the_thinking_as_a_reasoning_item(client):
    response = client.responses.create(model="scripted", input="weather", max_output_tokens=20, temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [part.text for part in reasoning.content] == [" need city "]
    assert message.type == "message" and response.output_text == f" <tool_call> {CALL} </tool_call>"
    events = list(client.responses.create(model="scripted", input="weather", max_output_tokens=20, temperature=0,
                                          stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done == " need city "
    assert events[-1].response.output[0].content[0].text == " need city "
    assert response.usage.output_tokens_details.reasoning_tokens == 4
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 4


def test_responses_carry_the_thinking_into_the_next_turn(client):
    """A reasoning item passed back (or recalled by previous_response_id) is the next assistant message's
    reasoning_content, which Qwen3's kind of template writes."""
    first = client.responses.create(model="scripted", input="weather", max_output_tokens=20, temperature=0)
    items = [{"role": "user", "content": "weather"}, *[item.model_dump() for item in first.output],
             {"role": "user", "content": "hello"}]
    from paged_hf.serving.openai.responses import input_messages  # noqa: PLC0415

    assert input_messages(items)[1]["reasoning_content"] == " need city "
    follow = client.responses.create(model="scripted", input="hello", previous_response_id=first.id,
                                     max_output_tokens=20, temperature=0)
    assert follow.output[0].type == "reasoning"


def test_messages_give_thinking_blocks_to_the_anthropic_sdk(server):
    anthropic = pytest.importorskip("anthropic")
    sdk = anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0, timeout=60)
    ask_messages = dict(model="scripted", max_tokens=20, messages=[{"role": "user", "content": "weather"}],
                        extra_body={"temperature": 0})  # (recent SDKs dropped the argument)
    thinking, text = sdk.messages.create(thinking={"type": "enabled", "budget_tokens": 2}, **ask_messages).content
    assert (thinking.type, thinking.thinking) == ("thinking", " need ")  # (the budget closed it)
    assert (text.type, text.text) == ("text", f" <tool_call> {CALL} </tool_call>")
    with sdk.messages.stream(thinking={"type": "adaptive"}, **ask_messages) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [
        ("thinking", " need city "), ("text", f" <tool_call> {CALL} </tool_call>")]
    (plain,) = sdk.messages.create(**ask_messages).content  # no thinking asked for: none given
    assert plain.text == text.text


def test_an_assistants_thinking_block_is_its_reasoning_content():
    from paged_hf.serving.openai.messages import chat_messages  # noqa: PLC0415
    from paged_hf.serving.openai.messages_protocol import MessagesRequest  # noqa: PLC0415

    body = MessagesRequest(max_tokens=4, messages=[
        {"role": "user", "content": "weather"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "need city", "signature": ""},
                                          {"type": "text", "text": "sunny"}]},
        {"role": "user", "content": "hello"}])
    assert chat_messages(body)[1] == {"role": "assistant", "content": "sunny", "reasoning_content": "need city"}
