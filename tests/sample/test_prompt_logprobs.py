"""Prompt logprobs from the engine equal HF's own (one full forward, log_softmax), whatever the chunking, prefix
cache, n or preemption; vLLM's token constraints (allowed_token_ids, bad_words, logit_bias) in the sampler."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leak, random_prompts, tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.sample.token_constraints import banned_tokens


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: log_softmax of HF's logits at positions 0..n-2 (they predict tokens 1..n-1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return logits[:-1].float().log_softmax(-1)


def check_against_hf(model, prompt, entries, k):
    expected = hf_prompt_logprobs(model, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for position in range(1, len(prompt)):
        entry, row = entries[position], expected[position - 1]
        assert entry is not None, position
        assert entry[prompt[position]] == pytest.approx(row[prompt[position]].item(), abs=1e-9)
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1, (position, entry, top)


@pytest.mark.parametrize("chunk", [256, 5])
def test_prompt_logprobs_equal_hf_across_chunks(llama, chunk):
    prompts = random_prompts([23, 9, 40], seed=3)
    generator = paged_hf.wrap(llama, num_blocks=64, block_size=4, max_num_batched_tokens=chunk).generator
    params = [SamplingParams(max_new_tokens=3, temperature=0, prompt_logprobs=k) for k in (0, 2, 5)]
    outputs = generator.generate(prompts, params, use_tqdm=False)
    for prompt, output, k in zip(prompts, outputs, (0, 2, 5)):
        check_against_hf(llama, prompt, output.prompt_logprobs, k)
    assert_no_leak(generator)


def test_prefix_cache_hit_does_not_lose_prompt_logprobs(llama):
    prompt = random_prompts([30], seed=4)[0]
    generator = paged_hf.wrap(llama, num_blocks=64, block_size=4).generator
    generator.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0), use_tqdm=False)  # fills the cache
    hits_before = generator.stats()["prefix_cache_hits"]
    params = SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=1, n=2)
    (output,) = generator.generate([prompt], params, use_tqdm=False)
    check_against_hf(llama, prompt, output.prompt_logprobs, 1)
    assert generator.stats()["prefix_cache_hits"] == hits_before  # computed again, not read from the cache
    (plain,) = generator.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0), use_tqdm=False)
    assert plain.prompt_logprobs is None and generator.stats()["prefix_cache_hits"] > hits_before
    assert_no_leak(generator)


def test_prompt_logprobs_survive_preemption():
    model = tiny_model("llama")
    prompts = random_prompts([20, 20, 20, 20], seed=5)
    generator = paged_hf.wrap(model, num_blocks=14, block_size=4, max_num_batched_tokens=8).generator
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0, prompt_logprobs=0,
                                                         ignore_eos=True), use_tqdm=False)
    assert generator.stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        check_against_hf(model, prompt, output.prompt_logprobs, 0)


def test_allowed_token_ids_and_logit_bias(llama):
    prompt = random_prompts([8], seed=6)[0]
    generator = paged_hf.wrap(llama, num_blocks=32, block_size=4).generator
    allowed = [5, 17, 99]
    (out,) = generator.generate([prompt], SamplingParams(max_new_tokens=12, temperature=1.0, seed=1,
                                                         allowed_token_ids=allowed), use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= set(allowed)
    (out,) = generator.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0, logit_bias={42: 100}),
                                use_tqdm=False)
    assert out.outputs[0].token_ids == [42] * 6
    (out,) = generator.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0, logit_bias={42: 100},
                                                         logprobs=0), use_tqdm=False)
    assert out.outputs[0].token_ids == [42] * 6 and out.outputs[0].logprobs[0][42] < 0  # logprobs stay raw


def test_bad_words_are_never_completed():
    assert banned_tokens([[7], [3, 4]], [1, 3]) == {7, 4}
    assert banned_tokens([[3, 4]], [3, 1]) == set()


def test_vllm_names_for_max_and_min_tokens():
    params = SamplingParams(max_tokens=7, min_tokens=2)
    assert (params.max_new_tokens, params.min_new_tokens, params.max_tokens, params.min_tokens) == (7, 2, 7, 2)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
