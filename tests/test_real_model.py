"""The real default model (SmolLM2-135M-Instruct, float32) through the engine: HF's exact greedy tokens."""

from __future__ import annotations

import pytest
import torch

import paged_hf
from paged_hf import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "Explain what a CPU does in one sentence."]


def chat(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


@pytest.mark.slow
def test_real_model_answers_paris_and_matches_hf_token_for_token(loaded):
    model, tokenizer = loaded
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    expected = []
    for prompt in prompts:  # the oracle: plain HF generate, one prompt at a time
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    engine = paged_hf.wrap(model, tokenizer, num_blocks=64, max_num_batched_tokens=48).generator
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0), use_tqdm=False)
    assert "Paris" in outputs[0].outputs[0].text
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]
