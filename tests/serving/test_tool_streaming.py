"""A tool call's arguments as a stream sends them (`calls_so_far`): cut anywhere, each call's arguments are a
prefix of what the whole text gives (`parse`, then `typed` by the tool's schema), so that the deltas add up to
the answer exactly, and what is sent is final: nothing is sent that a later character could change."""

from __future__ import annotations

import json

import pytest

from paged_hf.serving.openai.tool_parsers import PARSERS, parse_required, required_calls_so_far

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                           "options": {"type": "object"}, "note": {"type": "string"}}}


def states(parser, text: str, schema=None) -> list[list[str]]:
    """Each call's arguments as they grow over every cut of `text` (checked against the whole text's calls)."""
    parameters_of = (lambda name: schema) if schema is not None else None
    _, calls = parser.parse(text)
    calls = [(name, parser.typed(arguments, schema)) for name, arguments in calls]
    assert calls, "the whole text has calls"
    grown = []
    for cut in range(len(text) + 1):
        so_far = parser.calls_so_far(text[:cut], parameters_of)
        assert len(so_far) <= len(calls)
        for call, (name, arguments) in zip(so_far, calls):
            assert call.name == name and arguments.startswith(call.arguments), (cut, call, arguments)
        seen = [call.arguments for call in so_far]
        grown += [seen] if not grown or grown[-1] != seen else []
    assert grown[-1] == [arguments for _, arguments in calls]
    return grown


QWEN = ("Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=options>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=note>\nx < y\n\n"
        "</paramete r> \"q\"\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
        "</tool_call>")


@pytest.mark.parametrize("text", [
    QWEN,
    QWEN.replace("3\n</parameter>", "3\n"),  # no </parameter>: the next parameter ends it
    QWEN.replace("\n</parameter>\n</function>", "</function>"),  # the last one ends at </function>
    QWEN.replace("x < y", "if a:</function> b"),  # </function> inside a value: the last one ends the function
])
@pytest.mark.parametrize("schema", [SCHEMA, None])
def test_qwen3_coder_streams_the_json_it_builds(text, schema):
    grown = states(PARSERS["qwen3_coder"], text, schema)
    typed = json.loads(grown[-1][0])
    assert isinstance(typed["days"], int if schema else str) and json.loads(str(typed["days"])) == 3
    assert typed["note"].startswith("x < y\n") == ("x < y" in text)
    assert len(grown) > 20  # a string value character by character, not the call whole at the end
    assert not any(arguments[0].endswith("<") for arguments in grown if arguments)  # (a tag may be starting)


def test_qwen3_coder_holds_what_may_still_change():
    qwen3 = PARSERS["qwen3_coder"]
    opened = "<tool_call>\n<function=f>\n<parameter=a>\nline\n"
    assert qwen3.calls_so_far(opened)[0].arguments == '{"a": "line'  # the newline may be the format's
    assert qwen3.calls_so_far(opened + "</param")[0].arguments == '{"a": "line'
    assert qwen3.calls_so_far(opened + "more")[0].arguments == '{"a": "line\\nmore'
    assert qwen3.calls_so_far(opened.replace("a>\nline", "n>\n4"), lambda _: SCHEMA | {"properties": {
        "n": {"type": "integer"}}})[0].arguments == '{"n": '  # typed once whole
    assert qwen3.calls_so_far("<tool_call>\n<function=f") == []  # no name yet


@pytest.mark.parametrize("text", [
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>3</arg_value>\n<arg_key>options</arg_key>\n<arg_value>{'a': (1, 2)}</arg_value>\n</tool_call>"
    "<tool_call>get_time\n</tool_call>",
])
def test_glm45_streams_argument_by_argument(text):
    grown = states(PARSERS["glm45"], text)
    assert json.loads(grown[-1][0]) == {"city": "Paris", "days": 3, "options": {"a": [1, 2]}}
    assert ['{"city": ', '{"city": "Paris"', '{"city": "Paris", "days": '] == [g[0] for g in grown[2:5]]


@pytest.mark.parametrize("text", [
    "[get_weather(city='Paris, (FR)', days=3, options={'a': [1, 2]}, note=\"it's \\\"x\\\"\"), get_time()]",
    "[get_weather(city='''a,\nb)''',  # a comment, with (brackets\n days=3,), get_time()]",
])
def test_pythonic_streams_argument_by_argument(text):
    grown = states(PARSERS["pythonic"], text)
    assert json.loads(grown[-1][0])["days"] == 3
    assert grown[1] == ["{"] and grown[2][0].startswith('{"city": ') and grown[2][0].count(":") == 1


def test_required_answers_stream_as_written():
    text = '[{"name": "f", "arguments": {"a": 1,"b": [2]}}, {"name": "g", "arguments": {}}]'
    assert parse_required(text) == [("f", '{"a": 1,"b": [2]}'), ("g", "{}")]
    for cut in range(len(text)):
        for call, (name, arguments) in zip(required_calls_so_far(text[:cut]), parse_required(text)):
            assert call.name == name and arguments.startswith(call.arguments)


NOISE = ["<", ">", "/", "=", "\n", '"', "'", "{", "}", "[", "]", "(", ")", ",", ":", "\\", "#", "\\u", "'''",
         "<tool_call>", "</tool_call>", "<parameter=", "</parameter>", "</function>", "<arg_key>", "</arg_value>",
         "[TOOL_CALLS]", "<|start|>", "<|channel|>", "<|message|>", "<|call|>"]
ODD_SCHEMAS = [None, {}, {"properties": [1]}, {"properties": {"city": True, "days": {"type": ["integer", "null"]}}},
               {"properties": {"days": {"type": "integer"}}}]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_broken_output_never_raises(name):
    """Calls with characters inserted, dropped or cut off (a bad escape in a key, a tag left open...): parse,
    typed and calls_so_far answer (no call, or calls) and never raise, whatever the tool's schema says."""
    import random  # noqa: PLC0415

    rng, parser = random.Random(name), PARSERS[name]
    whole = "Hi. " + parser.format_calls([("get_weather", {"city": "Paris", "days": 3, "n": [1, {"a": "b"}]}),
                                          ("get_time", {})])
    for _ in range(300):
        text = whole
        for _ in range(rng.randint(1, 4)):
            at, kind = rng.randint(0, len(text)), rng.random()
            text = (text[:at] + rng.choice(NOISE) + text[at:] if kind < 0.4 else
                    text[:at] + text[at + rng.randint(1, 5):] if kind < 0.8 else text[:at])
        schema = rng.choice(ODD_SCHEMAS)
        for call_name, arguments in parser.parse(text)[1]:
            parser.typed(arguments, schema)
        for cut in (len(text), rng.randint(0, len(text))):
            parser.calls_so_far(text[:cut], lambda _: schema)
        parse_required(text), required_calls_so_far(text)
    assert PARSERS["hermes"].calls_so_far('<tool_call>{"na\\me": "f", "arguments": {}}') == []  # (a bad escape)
