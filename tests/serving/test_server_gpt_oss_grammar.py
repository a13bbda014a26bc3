"""A grammar on gpt-oss (`--reasoning-parser openai_gptoss`): the analysis channel is free and the grammar holds
from after `<|channel|>final<|message|>` (vLLM's behaviour), whether an analysis came first or not; a thinking
budget is refused naming why. Through a real server and the `openai` SDK, on a scripted model whose harmony
markers are special tokens of its tokenizer (tests/scripted_model.py)."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from conftest import assert_no_leak  # noqa: E402
from scripted_model import scripted_model, scripted_tokenizer  # noqa: E402
from tiny_server import serving  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402

SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
ANALYSIS = "<|channel|>analysis<|message|>"  # (one word of the script: the model writes it as one token)
# "city": think, then answer in the final channel; "direct": the final channel at once. Each word has one successor,
# and the final channel's header is three tokens, `<|channel|>` `final` `<|message|>`, as gpt-oss writes it.
SCRIPT = {
    "city": ANALYSIS, ANALYSIS: "Pick one.", "Pick one.": "<|end|>", "<|end|>": "<|start|>",
    "<|start|>": "assistant", "assistant": "<|channel|>", "<|channel|>": "final", "final": "<|message|>",
    "<|message|>": "Lyon is nice.", "Lyon is nice.": "<|return|>",
    "direct": "<|channel|>",
}
CITIES = ['"Paris"', '"Rome"']  # the grammar's answers, words of the vocabulary
TEMPLATE = "{# <|channel|> #}{% for m in messages %}{{ m['content'] }}{% endfor %}"
SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "string", "enum": ["Paris", "Rome"]}}}}


@pytest.fixture(scope="module")
def server():
    tokenizer = scripted_tokenizer([*SCRIPT, *SCRIPT.values(), *CITIES], TEMPLATE, exact=True, specials=SPECIALS)
    generator = paged_hf.wrap(scripted_model(tokenizer, SCRIPT), tokenizer, num_blocks=32, max_num_seqs=2).generator
    settings = ServerSettings(reasoning_parser="openai_gptoss")
    with serving(create_app(generator, tokenizer, "gpt-oss", settings)) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert_no_leak(generator)


def ask(client, word, **fields):
    return client.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": word}],
                                          max_tokens=16, temperature=0, **fields).choices[0]


def test_without_a_grammar_the_model_writes_its_own_answer(server):
    choice = ask(server[1], "city")
    assert (choice.message.model_extra["reasoning"], choice.message.content) == ("Pick one.", "Lyon is nice.")


def test_the_grammar_holds_after_the_final_channels_header(server):
    """The analysis is the model's own; the final channel follows the schema where the model would have written
    free text, whole and streamed."""
    choice = ask(server[1], "city", **SCHEMA)
    assert choice.message.model_extra["reasoning"] == "Pick one."
    assert json.loads(choice.message.content) in ("Paris", "Rome")
    reasoning, content = "", ""
    for chunk in server[1].chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": "city"}],
                                                   max_tokens=16, temperature=0, stream=True, **SCHEMA):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("Pick one.", choice.message.content)


def test_an_answer_without_analysis_is_held_to_the_grammar_too(server):
    choice = ask(server[1], "direct", **SCHEMA)
    assert choice.message.model_extra.get("reasoning") is None
    assert json.loads(choice.message.content) in ("Paris", "Rome")


def test_a_thinking_budget_is_refused_naming_why(server):
    """Closing harmony's analysis takes more than the final channel's header (`<|end|><|start|>assistant`
    first): not done, so refused rather than written wrong."""
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, json={
        "model": "gpt-oss", "messages": [{"role": "user", "content": "city"}], "thinking_token_budget": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
