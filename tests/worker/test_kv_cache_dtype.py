"""PagedConfig.kv_cache_dtype through the whole engine: sizing, greedy generation, prefix caching,
copy-on-write and preemption with an int8/fp8 cache."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leak, hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.kernels.quant import KV_CACHE_DTYPES
from paged_hf.worker.cache_sizing import bytes_per_block, num_blocks_from_memory

QUANTIZED = list(KV_CACHE_DTYPES)
LENGTHS = [5, 17, 33, 40, 9, 26]
MAX_NEW = [8, 20, 3, 12, 15, 6]


def greedy(max_new_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, **extra)


def run(model, prompts, max_new, **config):
    generator = paged_hf.ContinuousBatchGenerator(model, PagedConfig(**config))
    outputs = generator.generate(prompts, [greedy(n) for n in max_new], use_tqdm=False)
    assert_no_leak(generator)
    return [o.outputs[0].token_ids for o in outputs], generator


def test_kv_cache_dtype_is_validated():
    assert PagedConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's name
    with pytest.raises(ValueError, match="kv_cache_dtype.*'int4'"):
        PagedConfig(kv_cache_dtype="int4")


def test_the_same_memory_holds_2x_the_tokens_of_bf16_and_4x_of_float32():
    """Scales included (8 bytes per block and KV head): within 0.5% of 2x and 4x for the default model's shape."""
    heads, dims = [3] * 30, [64] * 30
    per_block = {dtype: bytes_per_block(16, heads, dims, dtype)
                 for dtype in (torch.float32, torch.bfloat16, *KV_CACHE_DTYPES.values())}
    for dtype in KV_CACHE_DTYPES.values():
        assert per_block[torch.bfloat16] / per_block[dtype] > 1.99
        assert per_block[torch.float32] / per_block[dtype] > 3.98
    generator = paged_hf.ContinuousBatchGenerator(tiny_model("llama", dtype=torch.float32),
                                                  PagedConfig(num_blocks=4))
    sized = {kv: num_blocks_from_memory(generator.info, PagedConfig(kv_cache_memory=1 << 20, kv_cache_dtype=kv), 512)
             for kv in ("auto", *QUANTIZED)}
    assert all(sized[kv] >= 3.9 * sized["auto"] for kv in QUANTIZED), sized


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_greedy_generation_with_a_quantized_cache(kv_cache_dtype, backend):
    """int8 keeps the tiny model's greedy tokens exactly; fp8 (3 or 2 mantissa bits) runs end to end and agrees
    on most of them (one flipped argmax changes everything after it)."""
    model = tiny_model("llama")
    prompts = random_prompts(LENGTHS)
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    got, generator = run(model, prompts, MAX_NEW, num_blocks=128, block_size=4, max_num_batched_tokens=64,
                         attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    assert generator.runner.kernel.name == backend
    assert generator.runner.cache.key_cache[0].dtype == KV_CACHE_DTYPES[kv_cache_dtype]
    assert [len(t) for t in got] == MAX_NEW
    if kv_cache_dtype == "int8":
        assert got == expected
    else:
        assert sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e)) >= 0.6 * sum(MAX_NEW)
        assert [g[0] for g in got] == [e[0] for e in expected]


def test_int8_under_preemption_and_chunked_prefill():
    """Preempted requests recompute their blocks (written in one prefill now, not token by token): with int8
    the tiny model's tokens do not change."""
    model = tiny_model("llama")
    prompts = random_prompts([30, 25, 35, 28, 22, 31])
    max_new = [25, 30, 20, 28, 26, 24]
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    got, generator = run(model, prompts, max_new, num_blocks=16, block_size=4, max_num_batched_tokens=32,
                         kv_cache_dtype="int8")
    assert generator.stats()["num_preemptions"] > 0
    assert got == expected


def logprob_trace(generator, prompt, max_new=6):
    out = generator.generate([prompt], greedy(max_new, logprobs=0), use_tqdm=False)[0].outputs[0]
    return out.token_ids, [list(entry.values()) for entry in out.logprobs]


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_reused_block_does_not_inherit_its_scale(kv_cache_dtype):
    """Without prefix caching a later request gets the freed blocks of an earlier one (with large values);
    its logprobs are those of a fresh engine to the last bit."""
    model = tiny_model("llama")
    config = dict(num_blocks=16, block_size=4, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    prompt = random_prompts([14], seed=3)[0]
    fresh = logprob_trace(paged_hf.ContinuousBatchGenerator(model, PagedConfig(**config)), prompt)
    generator = paged_hf.ContinuousBatchGenerator(model, PagedConfig(**config))
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        saved = embeddings.clone()
        embeddings *= 50  # the first request writes K/V far larger than the second one's
        try:
            generator.generate(random_prompts([40], seed=4), greedy(20), use_tqdm=False)
        finally:
            embeddings.copy_(saved)
    assert logprob_trace(generator, prompt) == fresh


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_copy_on_write_and_prefix_hits_carry_the_scales(kv_cache_dtype):
    """n=2 greedy children fork from the prompt's blocks (the partial last block is copied): both see the same
    K/V, so the same tokens and logprobs; a second request hitting the prefix cache reads the cached blocks
    with their scales and gets what a request without the hit gets."""
    model = tiny_model("llama")
    prompt = random_prompts([18], seed=5)[0]
    generator = paged_hf.ContinuousBatchGenerator(model, PagedConfig(num_blocks=64, block_size=4,
                                                                     kv_cache_dtype=kv_cache_dtype))
    first = generator.generate([prompt], greedy(10, n=2, logprobs=0), use_tqdm=False)[0].outputs
    assert first[0].token_ids == first[1].token_ids and first[0].logprobs == first[1].logprobs
    hit = logprob_trace(generator, prompt, 10)
    assert generator.stats()["prefix_cache_hits"] >= 16
    assert hit[0] == first[0].token_ids
    assert_no_leak(generator)
