"""FlashInfer kernel: its CSR metadata on CPU; the kernel itself against the torch kernel on a GPU (`make gpu-check`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from paged_hf.kernels.torch_kernel import TorchKernel
from paged_hf.kernels.flashinfer import build_csr
from paged_hf.worker.step_inputs import AttentionMetadata

BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 4, 64, 2, 64, 4


def random_batch(shapes, seed: int, dtype=torch.float64, device="cpu"):
    """A paged batch of requests with (cached, new) token counts, blocks scattered; K/V of every token written."""
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    tables, starts, lens, slots, full = [], [0], [], [], []
    for past, new in shapes:
        total = past + new
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype)
        v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype)
        for pos in range(total):
            key_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            value_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(past, total)]
        tables.append(table), lens.append(total), starts.append(starts[-1] + new), full.append((k, v))
    metadata = AttentionMetadata(BLOCK_SIZE, starts, lens, tables, torch.tensor(slots))
    return metadata, key_cache.to(device), value_cache.to(device), full


@pytest.mark.parametrize("shapes", [
    [(0, 9), (6, 1), (0, 1), (13, 5), (21, 1), (3, 4)],  # prefill chunks, chunks with a past, decodes
    [(7, 1), (12, 1), (3, 1), (4, 1)],  # decode only, last pages full and partial
    [(0, 8), (8, 8)],  # chunked prefill ending exactly on block boundaries
])
def test_csr_describes_exactly_the_tokens_the_torch_kernel_reads(shapes):
    metadata, key_cache, value_cache, full = random_batch(shapes, seed=len(shapes))
    csr = build_csr(metadata)
    assert all(t.dtype == torch.int32 for t in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len))
    assert csr.decode_only == all(new == 1 for _, new in shapes)
    assert csr.qo_indptr.tolist() == metadata.query_start_loc
    plan = TorchKernel().plan(metadata, torch.device("cpu"))
    torch_view = {}  # request index -> the blocks the torch kernel gathers for it
    for group in plan.decodes:
        for row, blocks in zip(group.rows.tolist(), group.block_ids.view(group.rows.shape[0], -1).tolist()):
            torch_view[metadata.query_start_loc.index(row)] = blocks
    for chunk in plan.prefills:
        if chunk.block_ids is not None:
            torch_view[metadata.query_start_loc.index(chunk.query_start)] = chunk.block_ids.tolist()
    for i, (k, v) in enumerate(full):
        pages = csr.kv_indices[csr.kv_indptr[i]:csr.kv_indptr[i + 1]].tolist()
        last = int(csr.kv_last_page_len[i])
        assert 1 <= last <= BLOCK_SIZE
        rebuilt_k = torch.cat([key_cache[p] for p in pages[:-1]] + [key_cache[pages[-1], :last]])
        rebuilt_v = torch.cat([value_cache[p] for p in pages[:-1]] + [value_cache[pages[-1], :last]])
        assert torch.equal(rebuilt_k, k) and torch.equal(rebuilt_v, v)  # every token, in order, nothing more
        if i in torch_view:
            assert torch_view[i][: len(pages)] == pages


has_flashinfer = importlib.util.find_spec("flashinfer") is not None
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and has_flashinfer), reason="needs CUDA and flashinfer")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 20.0)])
@pytest.mark.parametrize("shapes", [[(0, 9), (6, 1), (13, 5), (21, 1)], [(7, 1), (12, 1), (30, 1)]])
def test_flashinfer_matches_the_torch_kernel(shapes, window, softcap):
    from paged_hf.kernels.flashinfer import FlashInferKernel  # noqa: PLC0415

    metadata, key_cache, value_cache, _ = random_batch(shapes, seed=1, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(metadata.query_start_loc[-1], NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    slots = metadata.slot_mapping.cuda()
    new_k = key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]  # this step's K/V (already in the cache)
    new_v = value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
    outputs = []
    for kernel in (TorchKernel(), FlashInferKernel()):
        plan = kernel.plan(metadata, torch.device("cuda"))
        outputs.append(kernel.attend(query, new_k, new_v, key_cache, value_cache, plan, scaling=HEAD_DIM ** -0.5,
                                     sliding_window=window, softcap=softcap))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=2e-2)


def tiny_bf16_llama_on_cuda():
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # head_dim 64
    return LlamaForCausalLM(config).to(torch.bfloat16).cuda().eval()


@pytest.mark.gpu
@gpu
def test_end_to_end_bf16_against_hf_generate():
    from conftest import random_prompts  # noqa: PLC0415

    import paged_hf  # noqa: PLC0415
    from paged_hf import SamplingParams  # noqa: PLC0415

    model = tiny_bf16_llama_on_cuda()
    prompts = random_prompts([9, 30, 17])
    engine = paged_hf.wrap(model, num_blocks=64, block_size=16, attention_backend="flashinfer").generator
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt], device="cuda")
        expected = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        got = output.outputs[0].token_ids
        for step, (a, b) in enumerate(zip(got, expected.tolist())):
            if a != b:  # bf16: equal up to the first mismatch, and there each is in the other's top 5
                logits = model(torch.tensor([prompt + got[:step]], device="cuda")).logits[0, -1]
                top5 = logits.topk(5).indices.tolist()
                assert a in top5 and b in top5
                break


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_flashinfer_reads_an_fp8_cache_as_the_torch_kernel_does(kv_dtype):
    """kv_cache_dtype fp8: FlashInfer gets the fp8 cache and its (fixed, per-tensor) scales; the torch kernel
    reads the same bytes with the same scales."""
    from paged_hf.kernels.flashinfer import FlashInferKernel  # noqa: PLC0415
    from paged_hf.kernels.quant import KVScales, quantize  # noqa: PLC0415

    shapes = [(0, 9), (6, 1), (13, 5), (21, 1)]
    metadata, key_cache, value_cache, _ = random_batch(shapes, seed=2, dtype=torch.bfloat16, device="cuda")
    key_cache, value_cache = quantize(key_cache.float(), kv_dtype), quantize(value_cache.float(), kv_dtype)
    scales = KVScales.create(NUM_BLOCKS, NUM_KV_HEADS, "cuda", dynamic=False)
    query = torch.randn(metadata.query_start_loc[-1], NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    new = torch.zeros(query.shape[0], NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")  # unused
    outputs = []
    for kernel in (TorchKernel(), FlashInferKernel()):
        plan = kernel.plan(metadata, torch.device("cuda"))
        outputs.append(kernel.attend(query, new, new, key_cache, value_cache, plan, scaling=HEAD_DIM ** -0.5,
                                     sliding_window=None, softcap=None, scales=scales))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
def test_end_to_end_fp8_cache_on_flashinfer():
    from conftest import random_prompts  # noqa: PLC0415

    import paged_hf  # noqa: PLC0415
    from paged_hf import SamplingParams  # noqa: PLC0415

    model = tiny_bf16_llama_on_cuda()
    engine = paged_hf.wrap(model, num_blocks=64, block_size=16, attention_backend="flashinfer",
                           kv_cache_dtype="fp8_e4m3").generator
    assert engine.runner.cache.key_cache[0].dtype == torch.float8_e4m3fn
    outputs = engine.generate(random_prompts([9, 30, 17]), SamplingParams(max_new_tokens=12, temperature=0,
                              ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12, 12]
