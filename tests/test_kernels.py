"""The torch kernel against dense attention over each request's whole sequence, on random paged batches."""

from __future__ import annotations

import pytest
import torch

from paged_hf.integrations.transformers import register
from paged_hf.kernels import TorchKernel
from paged_hf.step_inputs import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 64


def dense_reference(q, k, v, scaling, window, softcap):
    """q: [query_len, heads, dim] for the last query_len positions of a sequence with K/V k, v: [len, kv, dim]."""
    query_len, context_len = q.shape[0], k.shape[0]
    groups = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(context_len - query_len, context_len)[:, None]
    key_pos = torch.arange(context_len)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 20.0), (3, 10.0)])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mixed_prefill_and_decode_batch_matches_dense(window, softcap, seed, dtype):
    torch.manual_seed(seed)
    # (context already cached, new tokens): fresh prompts, chunks with a past, and decodes
    shapes = [(0, 9), (6, 1), (0, 1), (13, 5), (21, 1), (3, 4)]
    permutation = torch.randperm(NUM_BLOCKS).tolist()  # scattered blocks, as after churn
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float64)
    value_cache = torch.zeros_like(key_cache)
    full_k, full_v, tables, slots, starts, context_lens = [], [], [], [], [0], []
    for past, new in shapes:
        total = past + new
        table = [permutation.pop() for _ in range((total + BLOCK_SIZE - 1) // BLOCK_SIZE)]
        k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float64)
        v = torch.randn_like(k)
        for pos in range(past):  # the past is already in the cache
            key_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            value_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(past, total)]
        full_k.append(k), full_v.append(v), tables.append(table), context_lens.append(total)
        starts.append(starts[-1] + new)
    metadata = AttentionMetadata(BLOCK_SIZE, starts, context_lens, tables, torch.tensor(slots))
    kernel = TorchKernel()
    plan = kernel.plan(metadata, torch.device("cpu"))
    new_k = torch.cat([k[past:] for k, (past, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[past:] for v, (past, _) in zip(full_v, shapes)])
    query = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM, dtype=torch.float64)
    key_cache, value_cache, new_k, new_v, query = (t.to(dtype) for t in (key_cache, value_cache, new_k, new_v, query))
    kernel.write_kv(new_k, new_v, key_cache, value_cache, plan)
    out = kernel.attend(query, new_k, new_v, key_cache, value_cache, plan, scaling=0.3, sliding_window=window, softcap=softcap)
    for i, (past, new) in enumerate(shapes):
        rows = slice(starts[i], starts[i + 1])
        expected = dense_reference(query[rows].double(), full_k[i], full_v[i], 0.3, window, softcap)
        tolerance = 1e-10 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out[rows], expected.to(dtype), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("family", ["llama", "mistral_window"])
def test_plain_forward_through_paged_hf_equals_sdpa(family):
    """Outside a paged step, the registered attention function is exactly sdpa (padding included)."""
    from conftest import tiny_model

    register()
    model = tiny_model(family)
    input_ids = torch.randint(3, 100, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # left padding
    model.set_attn_implementation("sdpa")
    expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
    model.set_attn_implementation("paged_hf")
    got = model(input_ids=input_ids, attention_mask=attention_mask).logits
    assert torch.equal(got, expected)


def test_wrap_leaves_the_model_untouched(llama):
    import paged_hf

    input_ids = torch.randint(3, 100, (1, 10))
    before = llama(input_ids=input_ids).logits
    implementation = llama.config._attn_implementation
    wrapped = paged_hf.wrap(llama, num_blocks=16, block_size=4)
    wrapped.generator.generate([[5, 6, 7]], paged_hf.SamplingParams(max_new_tokens=3), use_tqdm=False)
    assert llama.config._attn_implementation == implementation
    assert torch.equal(wrapped(input_ids=input_ids).logits, before)
    assert wrapped.unwrap() is llama and wrapped.config is llama.config and wrapped.device == llama.device
