"""Sparse attention over the tokens an indexer selects (DeepSeek-V3.2, Qwen4-Exp): the indexer keys live in the
K/V's blocks, so a prefix-cache hit reuses them; outside a step the paged attention function applies the
selection as the model's own sdpa path does; what would lose the indexer keys is refused."""

from __future__ import annotations

import pytest
import torch
from architectures import build
from conftest import hf_greedy

import paged_hf
from paged_hf import SamplingParams
from paged_hf.integrations.transformers import register

GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek():
    return build("deepseek_v32", torch.float64)  # index_topk 4: a 19-token prompt attends a few of its keys


def test_a_prefix_cache_hit_reuses_the_indexer_keys_of_its_blocks(deepseek):
    generator = torch.Generator().manual_seed(1)
    system = torch.randint(8, 120, (17,), generator=generator).tolist()
    prompts = [system + [9, 10, 11], system + [12, 13]]
    engine = paged_hf.wrap(deepseek, num_blocks=64, block_size=4, enable_prefix_caching=True).generator
    first = engine.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    second = engine.generate(prompts[1:], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.stats()["prefix_cache_hits"] >= 16  # the system prompt's four whole blocks
    assert [first, second] == [hf_greedy(deepseek, p, GREEDY.max_new_tokens) for p in prompts]


def test_plain_forward_through_paged_hf_applies_the_selection(deepseek):
    register()
    input_ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    deepseek.set_attn_implementation("sdpa")
    expected = deepseek(input_ids=input_ids).logits
    deepseek.set_attn_implementation("paged_hf")
    try:
        got = deepseek(input_ids=input_ids).logits
    finally:
        deepseek.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_the_kv_tier_is_refused_for_a_model_with_indexer_keys(deepseek):
    with pytest.raises(ValueError, match="indexer's keys"):
        paged_hf.wrap(deepseek, num_blocks=64, kv_offloading_size=0.01)
