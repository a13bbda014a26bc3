"""Each --tool-call-parser reads the calls it writes, leaves plain text alone, and holds back a starting call."""

from __future__ import annotations

import json

import pytest

from paged_hf.serving.openai.tool_parsers import PARSERS, parse_required

CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_round_trip_and_plain_text(name):
    parser = PARSERS[name]
    content, calls = parser.parse(parser.format_calls(CALLS))
    assert [(n, json.loads(a)) for n, a in calls] == CALLS and content == ""
    assert parser.parse("no calls here") == ("no calls here", [])
    assert parser.parse(parser.format_calls(CALLS)[:-3])[1] == []  # a cut call is not a call


@pytest.mark.parametrize("text, content, calls", [
    ('Let me see.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "Let me see.", [("f", '{"x": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"y": "z"}}',
     "", [("f", "{}"), ("g", '{"y": "z"}')]),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
])
def test_hermes(text, content, calls):
    assert PARSERS["hermes"].parse(text) == (content, calls)


def test_llama3_json_and_mistral_shapes():
    llama = PARSERS["llama3_json"]
    assert llama.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}') == (
        "", [("f", '{"a": 1}'), ("g", "{}")])
    assert llama.parse('The answer is {"name": "f"}')[1] == []
    mistral = PARSERS["mistral"]
    assert mistral.parse('Ok [TOOL_CALLS] [{"name": "f", "arguments": {"a": [1]}}]') == ("Ok", [("f", '{"a": [1]}')])


def test_streamed_content_stops_where_a_call_may_start():
    hermes, llama = PARSERS["hermes"], PARSERS["llama3_json"]
    assert hermes.safe_content_end("Hello <tool", "Hello <tool") == len("Hello ")
    assert hermes.safe_content_end("Hi <tool_call>{", "Hi <tool_call>{") == len("Hi ")
    assert hermes.safe_content_end("Hi <b>", "Hi <b>") == len("Hi <b>")
    assert llama.safe_content_end(' {"na', ' {"na') == 0 and llama.safe_content_end("Hello", "Hello") == 5


def test_required_answers():
    assert parse_required('[{"name": "f", "arguments": {"a": 1}}]') == [("f", '{"a": 1}')]
    assert parse_required('[{"name": "f", "arguments": {"a"') == [] and parse_required('{"name": "f"}') == []
