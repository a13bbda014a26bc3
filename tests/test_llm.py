"""`paged_hf.LLM`: vLLM's offline API from a model folder (`generate`, `chat`), equal to HF's generate."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, tiny_model

import paged_hf
from paged_hf import SamplingParams

pytest.importorskip("fastapi")
from tiny_server import tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llm")
    model = tiny_model("llama", dtype=torch.float32)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path, model


def test_llm_generate_and_chat_from_a_folder(folder):
    path, model = folder
    llm = paged_hf.LLM(str(path), num_blocks=32, max_model_len=128)
    assert llm.paged_model.dtype == torch.float32 and llm.get_tokenizer() is llm.tokenizer
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompt = [1, 7, 40, 10]
    outs = llm.generate([prompt, {"prompt_token_ids": prompt}, "the time"], greedy, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == hf_greedy(model, prompt, 5)
    assert outs[2].prompt_token_ids == llm.tokenizer("the time")["input_ids"]
    (single,) = llm.generate("the time", greedy, use_tqdm=False)
    assert single.outputs[0].token_ids == outs[2].outputs[0].token_ids
    chat = [{"role": "user", "content": "tell me the time"}]
    replies = llm.chat([chat, chat], greedy, use_tqdm=False)
    ids = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [r.prompt_token_ids for r in replies] == [list(ids)] * 2
    assert replies[0].outputs[0].token_ids == hf_greedy(model, list(ids), 5)
    (one,) = llm.chat(chat, greedy, use_tqdm=False)
    assert one.outputs[0].text == replies[0].outputs[0].text
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"text": "x"}, use_tqdm=False)
