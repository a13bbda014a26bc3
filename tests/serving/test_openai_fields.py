"""Every field of vLLM's completion and chat request models is honoured (tested here) or refused with a 400
that names it; unknown fields are refused; null means the default. Echo, prompt logprobs and batched prompts
through the real `openai` client, checked against HF's own forward pass."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import assert_no_leak, tiny_model  # noqa: E402
from tiny_server import serving, tiny_tokenizer  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.serving.openai import ServerSettings, create_app  # noqa: E402
from paged_hf.serving.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from paged_hf.serving.openai.request_fields import CHAT_REFUSED_UNLESS, COMPLETION_REFUSED_UNLESS, IGNORED  # noqa: E402

MODEL = "tiny"
CHAT = [{"role": "user", "content": "tell me the time"}]

# vLLM 0.32's CompletionRequest and ChatCompletionRequest fields (vllm/entrypoints/openai/*/protocol.py)
VLLM_COMPLETION_FIELDS = (
    "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream "
    "stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking "
    "length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
    "spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs "
    "logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority "
    "request_id session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start "
    "return_token_offsets mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs "
    "repetition_detection thinking_token_budget stream_interval").split()
VLLM_CHAT_FIELDS = (
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
    "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
    "reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p "
    "repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens "
    "skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs "
    "logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt continue_final_message "
    "add_special_tokens documents chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs "
    "structured_outputs priority request_id session_id return_tokens_as_token_ids return_token_ids "
    "routed_experts_prompt_start return_token_offsets return_prompt_text mm_payload return_mm_kwargs cache_salt "
    "kv_transfer_params ec_transfer_params vllm_xargs repetition_detection stream_interval").split()

# a value each refused field might really be sent with
NON_NEUTRAL = {"use_beam_search": True, "length_penalty": 0.5, "spaces_between_special_tokens": False,
               "truncation_side": "right", "priority": 1, "mm_payload": "base64", "echo": True, "tool_choice": "auto",
               "include_reasoning": False, "response_format": {"type": "json_object"}, "suffix": "end",
               "tools": [{"type": "function", "function": {"name": "f"}}], "reasoning_effort": "low",
               "routed_experts_prompt_start": 3, "parallel_tool_calls": "yes"}


@pytest.fixture(scope="module")
def fields_server():
    model = tiny_model("llama", dtype=torch.float32)
    generator = paged_hf.wrap(model, tiny_tokenizer(), num_blocks=128, block_size=4, max_num_seqs=16,
                              max_num_batched_tokens=64, max_model_len=256).generator
    app = create_app(generator, generator.tokenizer, MODEL, ServerSettings(max_n=4, max_tokens_cap=200,
                                                                        trust_request_chat_template=True))
    with serving(app) as url:
        yield url, generator, model
    assert_no_leak(generator)


@pytest.fixture(scope="module")
def client(fields_server):
    return openai.OpenAI(base_url=fields_server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[0] + path, json=body, timeout=60)


def complete(server, **body) -> dict:
    r = post(server, "/v1/completions", {"model": MODEL, "temperature": 0, "max_tokens": 6, **body})
    assert r.status_code == 200, r.text
    return r.json()


# --- the table: every vLLM field is ours, refused unless neutral, or ignored -------------------------------------

@pytest.mark.parametrize("model, vllm_fields, refused", [
    (CompletionRequest, VLLM_COMPLETION_FIELDS, COMPLETION_REFUSED_UNLESS),
    (ChatCompletionRequest, VLLM_CHAT_FIELDS, CHAT_REFUSED_UNLESS)])
def test_every_vllm_field_is_honoured_refused_or_ignored(model, vllm_fields, refused):
    honoured = set(model.model_fields) - set(refused)
    assert set(vllm_fields) <= honoured | set(refused) | IGNORED
    with open(Path(__file__).resolve().parents[2] / "docs" / "serving.md") as fh:
        docs = fh.read()
    assert all(f"`{name}`" in docs for name in vllm_fields), [n for n in vllm_fields if f"`{n}`" not in docs]


@pytest.mark.parametrize("path, name", [("/v1/completions", n) for n in COMPLETION_REFUSED_UNLESS] +
                         [("/v1/chat/completions", n) for n in CHAT_REFUSED_UNLESS])
def test_refused_fields_are_a_400_naming_them(fields_server, path, name):
    body = {"model": MODEL, "max_tokens": 2, name: NON_NEUTRAL.get(name, {"some": "value"})}
    body.update({"prompt": "the"} if path == "/v1/completions" else {"messages": CHAT})
    r = post(fields_server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    neutral = dict(body, **{name: refused_neutral(name)})
    assert post(fields_server, path, neutral).status_code == 200, name


def refused_neutral(name):
    table = {**COMPLETION_REFUSED_UNLESS, **CHAT_REFUSED_UNLESS}
    return table[name][-1]


def test_unknown_field_is_a_400_null_is_the_default_and_user_is_ignored(fields_server):
    r = post(fields_server, "/v1/completions", {"model": MODEL, "prompt": "the", "max_token": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token", r.text
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "stream",
                               "presence_penalty", "logit_bias", "min_tokens", "echo", "stream_options")}
    out = complete(fields_server, prompt="the", user="someone", **{**nulls, "max_tokens": None, "temperature": None,
                                                                    "seed": 1, "ignore_eos": True})
    assert out["choices"][0]["finish_reason"] in ("length", "stop") and out["usage"]["completion_tokens"] > 6
    chat = post(fields_server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": None,
                                                        "tools": None, "top_logprobs": None, "user": "u"})
    assert chat.status_code == 200, chat.text


# --- honoured fields ----------------------------------------------------------------------------------------

def test_logit_bias_allowed_token_ids_and_bad_words(fields_server):
    tok = fields_server[1].tokenizer
    water = tok.convert_tokens_to_ids("water")
    out = complete(fields_server, prompt="the", logit_bias={str(water): 100})
    assert out["choices"][0]["text"].split() == ["water"] * 6
    allowed = [tok.convert_tokens_to_ids(w) for w in ("time", "day")]
    out = complete(fields_server, prompt="the", allowed_token_ids=allowed, temperature=1.0, seed=3, max_tokens=10)
    assert set(out["choices"][0]["text"].split()) <= {"time", "day"}
    plain = complete(fields_server, prompt="the", max_tokens=10)["choices"][0]["text"].split()
    word = plain[0]
    banned = complete(fields_server, prompt="the", max_tokens=10, bad_words=[word])["choices"][0]["text"].split()
    assert word not in banned
    assert post(fields_server, "/v1/completions", {"model": MODEL, "prompt": "the",
                                                   "logit_bias": {"5": 101}}).status_code == 400
    for field, value in (("logit_bias", {"500": 1}), ("allowed_token_ids", [3, 500])):
        r = post(fields_server, "/v1/completions", {"model": MODEL, "prompt": "the", field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_min_tokens_stop_token_ids_and_stop_reason(fields_server):
    plain = complete(fields_server, prompt=[1, 7, 40, 10], max_tokens=8, logprobs=0)
    tokens = fields_server[1].tokenizer.convert_tokens_to_ids(plain["choices"][0]["logprobs"]["tokens"])
    stop_id = tokens[2]
    out = complete(fields_server, prompt=[1, 7, 40, 10], max_tokens=8, stop_token_ids=[stop_id])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert out["usage"]["completion_tokens"] == tokens.index(stop_id) + 1
    held = complete(fields_server, prompt=[1, 7, 40, 10], max_tokens=8, stop_token_ids=[stop_id], min_tokens=8)
    assert held["usage"]["completion_tokens"] == 8 and stop_id not in fields_server[1].tokenizer.convert_tokens_to_ids(
        held["choices"][0]["text"].split())


def test_include_stop_str_in_output_and_skip_special_tokens(fields_server):
    text = complete(fields_server, prompt="the time", max_tokens=10)["choices"][0]["text"]
    stop = text.split()[1]
    cut = complete(fields_server, prompt="the time", max_tokens=10, stop=[stop])["choices"][0]
    kept = complete(fields_server, prompt="the time", max_tokens=10, stop=[stop],
                    include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == cut["text"] + stop and kept["stop_reason"] == stop == cut["stop_reason"]
    forced = dict(prompt="the", max_tokens=3, logit_bias={"1": 100}, ignore_eos=True)  # "<s>", a special token
    assert complete(fields_server, **forced)["choices"][0]["text"] == ""
    assert "<s>" in complete(fields_server, skip_special_tokens=False, **forced)["choices"][0]["text"]


def test_cache_salt_separates_prefix_cache(fields_server):
    generator = fields_server[1]
    prompt = "the time of day is the time of day is the time"
    complete(fields_server, prompt=prompt, cache_salt="tenant-a")
    hits = generator.stats()["prefix_cache_hits"]
    complete(fields_server, prompt=prompt, cache_salt="tenant-b")
    assert generator.stats()["prefix_cache_hits"] == hits
    complete(fields_server, prompt=prompt, cache_salt="tenant-a")
    assert generator.stats()["prefix_cache_hits"] > hits


def test_chat_template_kwargs_template_and_generation_prompt(fields_server):
    template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}{% if extra %}water {% endif %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    base = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "chat_template": template}
    with_kwarg = post(fields_server, "/v1/chat/completions", {**base, "chat_template_kwargs": {"extra": True}}).json()
    without = post(fields_server, "/v1/chat/completions", base).json()
    assert with_kwarg["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1
    same = complete(fields_server, prompt="tell me the time water <assistant>", max_tokens=5, add_special_tokens=False)
    assert with_kwarg["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    no_gen = post(fields_server, "/v1/chat/completions", {**base, "add_generation_prompt": False}).json()
    assert no_gen["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] - 1
    cont = post(fields_server, "/v1/chat/completions", {**base, "add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert cont.status_code == 200, cont.text
    bad = post(fields_server, "/v1/chat/completions", {**base, "chat_template": "{% if %}"})
    assert bad.status_code == 400


def test_truncate_prompt_tokens_and_add_special_tokens(fields_server):
    full = complete(fields_server, prompt="the time of day is", truncate_prompt_tokens=2)
    assert full["usage"]["prompt_tokens"] == 2
    assert full["choices"][0]["text"] == complete(fields_server, prompt="day is", add_special_tokens=False)[
        "choices"][0]["text"]


# --- echo, prompt logprobs, batched prompts --------------------------------------------------------------------

def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_with_logprobs_equals_hf(fields_server, client):
    model, tok = fields_server[2], fields_server[1].tokenizer
    prompt = "the time of day is"
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = out.choices[0]
    ids = tok(prompt)["input_ids"]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = hf_logprobs(model, ids)
    for position in range(1, len(ids)):
        assert lp.token_logprobs[position] == pytest.approx(expected[position - 1, ids[position]].item(), abs=1e-4)
        assert len(lp.top_logprobs[position]) >= 1
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    only = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert only.choices[0].text == prompt and len(only.choices[0].logprobs.tokens) == len(ids)
    assert only.usage.completion_tokens == 0
    assert post(fields_server, "/v1/completions", {"model": MODEL, "prompt": "the", "max_tokens": 0}).status_code == 400


def test_prompt_logprobs_field_on_completions_and_chat(fields_server):
    model = fields_server[2]
    out = complete(fields_server, prompt=[1, 7, 40, 10, 9], prompt_logprobs=2)
    entries = out["choices"][0]["prompt_logprobs"]
    expected = hf_logprobs(model, [1, 7, 40, 10, 9])
    assert entries[0] is None and len(entries) == 5
    assert entries[3]["10"]["logprob"] == pytest.approx(expected[2, 10].item(), abs=1e-4)
    chat = post(fields_server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    streamed = post(fields_server, "/v1/completions", {"model": MODEL, "prompt": "the", "prompt_logprobs": 1,
                                                       "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_batched_prompts_with_openai_choice_indexing(fields_server, client):
    prompts = ["the time", "of day is", "water"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
               for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [s for s in singles for _ in range(2)]
    assert batch.usage.completion_tokens == 24
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, stream=True)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == singles
    echoed = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=2, echo=True, temperature=0)
    assert [c.text[:len(p)] for c, p in zip(echoed.choices, prompts)] == prompts[:2]
    by_ids = client.completions.create(model=MODEL, prompt=[[1, 40, 9], [1, 7]], max_tokens=3, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1] and by_ids.usage.prompt_tokens == 5
    bad = post(fields_server, "/v1/completions", {"model": MODEL, "prompt": [[1, 7], [1, 999]]})
    assert bad.status_code == 400
    assert post(fields_server, "/v1/completions", {"model": MODEL, "prompt": ["the", [1, 7]]}).status_code == 400
