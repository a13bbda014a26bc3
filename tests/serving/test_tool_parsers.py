"""Each --tool-call-parser reads the calls it writes, leaves plain text alone, and holds back a starting call.

The per-format cases are vLLM's (the file named above each set, under vllm-project/vllm's tests/tool_parsers/),
with our parsers' conventions: content is stripped ("" where vLLM says None), and a malformed or cut call makes
the whole text content.
"""

from __future__ import annotations

import argparse
import json

import pytest

from paged_hf.entrypoints.cli import add_serve_args
from paged_hf.serving.openai.tool_formats.special_tokens import DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALLS_BEGIN
from paged_hf.serving.openai.tool_parsers import PARSERS, parse_required, tool_text

CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def decoded(result):
    """(content, [(name, arguments as a dict)]): vLLM's cases compare arguments as JSON values."""
    content, calls = result
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_round_trip_and_plain_text(name):
    parser = PARSERS[name]
    content, calls = parser.parse(parser.format_calls(CALLS))
    assert [(n, json.loads(a)) for n, a in calls] == CALLS and content == ""
    assert parser.parse("no calls here") == ("no calls here", [])
    assert parser.parse(parser.format_calls(CALLS)[:-3])[1] == []  # a cut call is not a call


def test_cli_offers_every_parser():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    (action,) = [a for a in parser._actions if a.dest == "tool_call_parser"]
    assert action.choices == sorted(PARSERS)


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


DALLAS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
QWEN_DALLAS = ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n"
               "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>")


# test_qwen3coder_tool_parser.py (parse alone: values as text; `typed` below types them by the tool's schema)
@pytest.mark.parametrize("text, content, calls", [
    (QWEN_DALLAS, "", [("get_current_weather", DALLAS)]),
    ("Sure! Let me check the weather for you." + QWEN_DALLAS, "Sure! Let me check the weather for you.",
     [("get_current_weather", DALLAS)]),
    (QWEN_DALLAS + "\n" + QWEN_DALLAS.replace("Dallas", "Orlando").replace("TX", "FL"), "",
     [("get_current_weather", DALLAS), ("get_current_weather", {**DALLAS, "city": "Orlando", "state": "FL"})]),
    ("Let me calculate that area for you.<tool_call>\n<function=calculate_area>\n<parameter=shape>\ncircle\n"
     "</parameter>\n<parameter=dimensions>\n{\"radius\": 15.5}\n</parameter>\n<parameter=precision>\n3\n</parameter>\n"
     "</function>\n</tool_call>", "Let me calculate that area for you.",
     [("calculate_area", {"shape": "circle", "dimensions": '{"radius": 15.5}', "precision": "3"})]),
    ("Let me check the weather for you:\n" + QWEN_DALLAS.replace("Dallas\n</parameter>", "Dallas"),  # no </parameter>
     "Let me check the weather for you:", [("get_current_weather", DALLAS)]),
    ("This is a test response without any tool calls", "This is a test response without any tool calls", []),
    (QWEN_DALLAS.removesuffix("</tool_call>"), QWEN_DALLAS.removesuffix("</tool_call>"), []),  # ours: left open
])
def test_qwen3_coder(text, content, calls):
    assert decoded(PARSERS["qwen3_coder"].parse(text)) == (content, calls)


def test_qwen3_coder_values_are_typed_by_the_tools_schema():
    """vLLM's typed case: with the request's tool, `precision` 3 is an integer and `dimensions` an object."""
    schema = {"type": "object", "properties": {"shape": {"type": "string"}, "dimensions": {"type": "object"},
                                               "precision": {"type": "integer"}}}
    text = json.dumps({"shape": "circle", "dimensions": '{"radius": 15.5}', "precision": "3", "note": "7"})
    typed = json.loads(PARSERS["qwen3_coder"].typed(text, schema))
    assert typed == {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3, "note": "7"}
    assert json.loads(PARSERS["qwen3_coder"].typed(text, None))["precision"] == "3"  # no schema: text
    assert PARSERS["hermes"].typed(text, schema) == text  # JSON formats carry their own types


SIMPLE = ("get_weather(city='San Francisco', metric='celsius')",
          ("get_weather", '{"city": "San Francisco", "metric": "celsius"}'))
MORE_TYPES = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
              "passed_test=True, aliases=['John', 'Johnny'])",
              ("register_user", '{"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"}, '
                                '"role": null, "passed_test": true, "aliases": ["John", "Johnny"]}'))


# test_pythonic_tool_parser.py (arguments compared as text, as there)
@pytest.mark.parametrize("text, calls", [
    (f"[{SIMPLE[0]}]", [SIMPLE[1]]),
    (f"[{MORE_TYPES[0]}]", [MORE_TYPES[1]]),
    ("[get_weather()]", [("get_weather", "{}")]),
    ("[do_something_cool(additional_data={})]", [("do_something_cool", '{"additional_data": {}}')]),
    ("[do_something_cool(steps=[])]", [("do_something_cool", '{"steps": []}')]),
    (r"""[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]""",
     [("get_weather", '{"city": "Martha\'s Vineyard", "metric": "\\"cool units\\""}')]),
    (f"[{SIMPLE[0]}, {MORE_TYPES[0]}]", [SIMPLE[1], MORE_TYPES[1]]),
])
def test_pythonic(text, calls):
    assert PARSERS["pythonic"].parse(text) == ("", calls)


@pytest.mark.parametrize("text", [
    "How can I help you today?",  # vLLM's
    "[f(a='x 'y', b='z')]",  # vLLM's: not Python
    f"[bad(x=b'z'), {SIMPLE[0]}]", f"[calc(x=1e999), {SIMPLE[0]}]",  # vLLM's; ours: no JSON form, so no calls
    "[f(1)]", "[f(x=g())]", "[f(**kw)]", "[1, 2]", "[]", f"Sure: [{SIMPLE[0]}]",  # ours: not literal keyword calls
])
def test_pythonic_other_text_is_content(text):
    assert PARSERS["pythonic"].parse(text) == (text, [])


def deepseek(text: str) -> str:
    """vLLM's DeepSeek cases, written here with ASCII stand-ins for the full-width tokens."""
    for words in ("tool calls begin", "tool calls end", "tool call begin", "tool call end", "tool sep"):
        text = text.replace(f"<|{words.replace(' ', '_')}|>", f"<\uff5c{words.replace(' ', chr(0x2581))}\uff5c>")
    return text


def test_deepseek_tokens_are_the_models():
    assert (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN) == ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")


# test_deepseekv31_tool_parser.py
@pytest.mark.parametrize("text, content, calls", [
    ('normal text<|tool_calls_begin|><|tool_call_begin|>foo<|tool_sep|>{"x":1}<|tool_call_end|><|tool_calls_end|>',
     "normal text", [("foo", '{"x":1}')]),
    ('some prefix text<|tool_calls_begin|><|tool_call_begin|>foo<|tool_sep|>{"x":1}<|tool_call_end|>'
     '<|tool_call_begin|>bar<|tool_sep|>{"y":2}<|tool_call_end|><|tool_calls_end|> some suffix text',
     "some prefix text", [("foo", '{"x":1}'), ("bar", '{"y":2}')]),
    ("Let me look that up.<|tool_calls_begin|>get_weather", None, []),
    ('<|tool_calls_begin|>foo<|tool_sep|>{"x":1}<|tool_calls_end|>', None, []),
    ('<|tool_calls_begin|><|tool_call_begin|>foo<|tool_sep|>{"x":<|tool_call_end|><|tool_calls_end|>', None,
     []),  # ours: arguments that are not JSON
])
def test_deepseek_v31(text, content, calls):
    text = deepseek(text)
    assert PARSERS["deepseek_v31"].parse(text) == (text if content is None else content, calls)


DS_WEATHER = ('<|tool_call_begin|>function<|tool_sep|>get_weather\n```json\n{"city": "Tokyo", "unit": "celsius"}\n```'
              "<|tool_call_end|>")
TOKYO = ("get_weather", {"city": "Tokyo", "unit": "celsius"})


# test_deepseekv3_tool_parser.py
@pytest.mark.parametrize("text, content, calls", [
    (f"<|tool_calls_begin|>{DS_WEATHER}<|tool_calls_end|>", "", [TOKYO]),
    (f"<|tool_calls_begin|>{DS_WEATHER}<|tool_call_begin|>function<|tool_sep|>search_hotels\n```json\n"
     '{"location": "Tokyo", "check_in": "2025-01-15"}\n```<|tool_call_end|><|tool_calls_end|>', "",
     [TOKYO, ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"})]),
    ("<|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|>get_current_time\n```json\n{}\n```<|tool_call_end|>"
     "<|tool_calls_end|>", "", [("get_current_time", {})]),
    ("Let me check the weather for you.<|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|>get_weather\n"
     '```json\n{"city": "Paris"}\n```<|tool_call_end|><|tool_calls_end|>', "Let me check the weather for you.",
     [("get_weather", {"city": "Paris"})]),
    ("<|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|>get_weather\n```json\n{\"city\": \"Tokyo\"\n```"
     "<|tool_call_end|><|tool_calls_end|>", None, []),
    ('<|tool_calls_begin|>function<|tool_sep|>get_weather\n```json\n{"city": "Tokyo"}\n```<|tool_calls_end|>', None,
     []),
    ("How can I help you today? I can check weather for you.", None, []),
])
def test_deepseek_v3(text, content, calls):
    text = deepseek(text)
    assert decoded(PARSERS["deepseek_v3"].parse(text)) == (text if content is None else content, calls)


GLM_DALLAS = ("<tool_call>get_current_weather\n    <arg_key>city</arg_key>\n    <arg_value>Dallas</arg_value>\n"
              "    <arg_key>state</arg_key>\n    <arg_value>TX</arg_value>\n    <arg_key>unit</arg_key>\n"
              "    <arg_value>fahrenheit</arg_value>\n    </tool_call>")
GLM_BEIJING = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
               "<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>\n</tool_call>")
BEIJING = ("get_weather", {"city": "Beijing", "date": "2025-08-01"})


# test_glm4_moe_tool_parser.py
@pytest.mark.parametrize("text, content, calls", [
    (GLM_DALLAS, "", [("get_current_weather", DALLAS)]),
    (GLM_DALLAS + "\n    " + GLM_DALLAS.replace("Dallas", "Orlando").replace("TX", "FL"), "",
     [("get_current_weather", DALLAS), ("get_current_weather", {**DALLAS, "city": "Orlando", "state": "FL"})]),
    ("I will help you get the weather." + GLM_BEIJING, "I will help you get the weather.", [BEIJING]),
    ("<think>I want to get the weather.</think>\n\nI will help you get the weather.\n" + GLM_BEIJING,
     "<think>I want to get the weather.</think>\n\nI will help you get the weather.", [BEIJING]),
    ("I will help you get the weather info.\n\n" + GLM_BEIJING + "\n\nmeaningwhile, I will also check the weather in "
     "Shanghai.\n\n" + GLM_BEIJING.replace("Beijing", "Shanghai"), "I will help you get the weather info.",
     [BEIJING, ("get_weather", {"city": "Shanghai", "date": "2025-08-01"})]),
    ("<tool_call>get_current_time\n</tool_call>", "", [("get_current_time", {})]),
    ("<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n<arg_key>o</arg_key>\n<arg_value>{\"a\": [1]}"
     "</arg_value>\n</tool_call>", "", [("f", {"n": 42, "o": {"a": [1]}})]),  # ours: no schema, values read as JSON
    (GLM_BEIJING.removesuffix("\n</tool_call>"), None, []),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Seattle</arg_value>\n<arg_key>incomplete_arg\n"
     "<arg_value>value</arg_value>\n</tool_call>", None, []),
])
def test_glm45(text, content, calls):
    assert decoded(PARSERS["glm45"].parse(text)) == (text if content is None else content, calls)


def kimi(*calls: tuple[str, str]) -> str:
    return ("<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>{call_id} <|tool_call_argument_begin|>{arguments}<|tool_call_end|>"
        for call_id, arguments in calls) + "<|tool_calls_section_end|>")


# test_kimi_k2_tool_parser.py
@pytest.mark.parametrize("text, content, calls", [
    ("I'll check. " + kimi(("functions.get_weather:0", '{"city": "Beijing"}')), "I'll check.",
     [("get_weather", {"city": "Beijing"})]),
    ("Compare weather. " + kimi(("functions.get_weather:0", '{"city": "Beijing"}'),
                                ("functions.get_weather:1", '{"city": "Shanghai"}')), "Compare weather.",
     [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})]),
    ("Multiple tasks. " + kimi(("functions.get_weather:0", '{"city": "New York"}'),
                               ("functions.get_news:1", '{"topic": "technology"}'),
                               ("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}')),
     "Multiple tasks.", [("get_weather", {"city": "New York"}), ("get_news", {"topic": "technology"}),
                         ("send_email", {"to": "user@example.com", "subject": "Daily Update"})]),
    ("Process HTML. " + kimi(("functions.process_html:0", '{"html": "<div>content</div>"}')), "Process HTML.",
     [("process_html", {"html": "<div>content</div>"})]),
    ("Formatted. " + kimi(("functions.process_data:0", '{\n  "name": "test",\n  "value": 123\n}')), "Formatted.",
     [("process_data", {"name": "test", "value": 123})]),
    ("No prefix. " + kimi(("get_weather:0", '{"city": "Tokyo"}')), "No prefix.", [("get_weather", {"city": "Tokyo"})]),
    ("Empty args. " + kimi(("functions.test:0", "{}")), "Empty args.", [("test", {})]),
    ("This is a test", None, []),
    # vLLM returns these calls with the arguments as written or skips the bad one; ours: all content
    ("Help. " + kimi(("functions.bad:0", '{"city": "Beijing"'), ("functions.good:1", '{"city": "Shanghai"}')), None,
     []),
    ("Help. " + kimi(("functions.invalid.0", '{"city": "Beijing"}')), None, []),
])
def test_kimi_k2(text, content, calls):
    assert decoded(PARSERS["kimi_k2"].parse(text)) == (text if content is None else content, calls)


# test_granite_tool_parser.py
@pytest.mark.parametrize("text, calls", [
    ('<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', [("get_weather", {"city": "Tokyo"})]),
    ('<|tool_call|> [\n  {"name": "get_weather", "arguments": {"city": "Tokyo"}},\n  {"name": "get_time", "arguments": '
     '{"timezone": "Asia/Tokyo"}}\n]', [("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})]),
    ('<tool_call> [{\n  "name": "test_function",\n  "arguments": {\n    "string_field": "hello",\n'
     '    "int_field": 42,\n    "null_field": null,\n    "object_field": {"nested": "value"}\n  }\n}]',
     [("test_function", {"string_field": "hello", "int_field": 42, "null_field": None,
                         "object_field": {"nested": "value"}})]),
    ('<|tool_call|> [{"name": "refresh", "arguments": {}}]', [("refresh", {})]),
    ('<tool_call> [{"name": "test_function", "arguments": {"quoted": "He said \\"hello\\"", '
     '"newline": "line1\\nline2"}}]',
     [("test_function", {"quoted": 'He said "hello"', "newline": "line1\nline2"})]),
])
def test_granite(text, calls):
    assert decoded(PARSERS["granite"].parse(text)) == ("", calls)


@pytest.mark.parametrize("text", [  # test_granite_tool_parser.py's malformed inputs and text around a call
    '<|tool_call|> [{"name": "func", "arguments": {',
    '<|tool_call|> {"name": "func", "arguments": {}}',
    '[{"name": "func", "arguments": "not a dict"}]',
    'Some text [{"name": "func"}]',
    'Let me check the weather for you.\n<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]\n'
    "I'll get that information.",
])
def test_granite_malformed_is_content(text):
    assert PARSERS["granite"].parse(text) == (text, [])


def test_streamed_content_stops_where_a_call_may_start():
    hermes, llama = PARSERS["hermes"], PARSERS["llama3_json"]
    assert hermes.safe_content_end("Hello <tool", "Hello <tool") == len("Hello ")
    assert hermes.safe_content_end("Hi <tool_call>{", "Hi <tool_call>{") == len("Hi ")
    assert hermes.safe_content_end("Hi <b>", "Hi <b>") == len("Hi <b>")
    assert llama.safe_content_end(' {"na', ' {"na') == 0 and llama.safe_content_end("Hello", "Hello") == 5


@pytest.mark.parametrize("name, partial_marker", [
    ("qwen3_coder", "<tool_"), ("glm45", "<tool_c"), ("kimi_k2", "<|tool_calls_sec"),
    ("deepseek_v3", DEEPSEEK_CALLS_BEGIN[:5]), ("deepseek_v31", DEEPSEEK_CALLS_BEGIN[:-1]),
])
def test_streamed_content_stops_before_a_marker(name, partial_marker):
    parser = PARSERS[name]
    assert parser.safe_content_end("Hi " + partial_marker, "Hi " + partial_marker) == len("Hi ")
    assert parser.safe_content_end("Hi <b>", "Hi <b>") == len("Hi <b>")
    # a special-token marker is only in the raw text; the content stops where it is
    assert parser.safe_content_end("Hi there", "Hi " + parser.marker + "there") == len("Hi ")


def test_streamed_whole_output_formats_hold_back_a_starting_call():
    pythonic, granite = PARSERS["pythonic"], PARSERS["granite"]
    assert pythonic.safe_content_end(" [get_w", " [get_w") == 0 and pythonic.safe_content_end("Hello", "Hello") == 5
    assert granite.safe_content_end("[", "<|tool_call|>[") == 0 and granite.safe_content_end("", "<|tool") == 0
    assert granite.safe_content_end("<tool_call> [", "<tool_call> [") == 0
    assert granite.safe_content_end("Hello", "Hello") == 5


class SpecialTokens:
    """A tokenizer whose text is given: what tool_text drops or keeps of its special tokens."""

    def __init__(self, text: str, specials: list[str]):
        self.text, self.all_special_tokens = text, specials

    def decode(self, token_ids, skip_special_tokens):
        return self.text


def test_tool_text_keeps_every_marker_of_the_format():
    kimi_k2 = PARSERS["kimi_k2"]
    markers = [kimi_k2.marker, *kimi_k2.inner_markers]
    text = "Ok " + kimi(("functions.f:0", "{}")) + "<|im_end|>"
    kept = tool_text(SpecialTokens(text, [*markers, "<|im_end|>"]), [], kimi_k2)
    assert kept == text.removesuffix("<|im_end|>") and kimi_k2.parse(kept) == ("Ok", [("f", "{}")])
    assert tool_text(SpecialTokens(text, markers), [], PARSERS["hermes"]) == "Ok functions.f:0 {}<|im_end|>"


def test_required_answers():
    assert parse_required('[{"name": "f", "arguments": {"a": 1}}]') == [("f", '{"a": 1}')]
    assert parse_required('[{"name": "f", "arguments": {"a"') == [] and parse_required('{"name": "f"}') == []


# gpt-oss (OpenAI's harmony format guide): a commentary message to functions.NAME, its body the arguments
GPT_OSS_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}<|call|>')


@pytest.mark.parametrize("text, content, calls", [
    (GPT_OSS_CALL, "", [("get_weather", '{"location": "Tokyo"}')]),
    ("<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.get_weather"
     '<|channel|>commentary json<|message|>{"location": "Tokyo"}<|call|>', "Checking both.",
     [("get_weather", '{"location": "Tokyo"}')]),  # the recipient in the header's role part
    (GPT_OSS_CALL.replace("}<|call|>", ""), None, []),  # cut before <|call|>
    (GPT_OSS_CALL.replace('{"location": "Tokyo"}', "Tokyo"), None, []),  # arguments that are not a JSON object
    ("<|channel|>final<|message|>Hi!<|return|>", None, []),
])
def test_openai_harmony(text, content, calls):
    assert PARSERS["openai"].parse(text) == (text if content is None else content, calls)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_calls_so_far_grow_into_the_parsed_calls(name):
    """Cut anywhere, a format that streams arguments reports each call's arguments as a prefix of what the whole
    text parses to, and the whole text's calls exactly: the deltas a stream sends add up to the answer."""
    parser = PARSERS[name]
    text = "Let me check. " * (name in ("hermes", "mistral")) + parser.format_calls(CALLS)
    if parser.calls_so_far(text) is None:  # (its calls go out whole)
        assert all(parser.calls_so_far(text[:cut]) is None for cut in range(len(text)))
        return
    content, calls = parser.parse(text)
    assert [(c.name, c.arguments, c.complete) for c in parser.calls_so_far(text)] == [(n, a, True) for n, a in calls]
    for cut in range(len(text)):
        so_far = parser.calls_so_far(text[:cut])
        assert len(so_far) <= len(calls)
        for call, (name_, arguments) in zip(so_far, calls):
            assert call.name == name_ and arguments.startswith(call.arguments)
