"""The quantized KV cache (int8, fp8): the write/read round trip, the scales of blocks filled over several steps,
and the torch and CPU kernels against dense attention over the dequantized values."""

from __future__ import annotations

import pytest
import torch
from test_kernels import dense_reference, specs

from paged_hf.kernels.selection import select_kernel
from paged_hf.kernels.torch_kernel import TorchKernel
from paged_hf.kernels.cpu_kernel import CpuKernel
from paged_hf.kernels.quant import KV_CACHE_DTYPES, QMAX, KVScales, dequantize, plan_write, write_quantized
from paged_hf.worker.step_inputs import AttentionMetadata

KV_DTYPES = list(KV_CACHE_DTYPES.values())
#: one rounding: |dequantized - true| <= RELATIVE * |true| + ABSOLUTE * scale. int8 rounds to half a step; fp8
#: to half an ulp of its mantissa (2^-4 e4m3, 2^-3 e5m2) above its subnormals (steps of 2^-9 / 2^-16 of 448 / 57344
#: times the scale). A block whose scale grew k times was rounded k + 1 times, each time at a scale <= the final.
BOUNDS = {torch.int8: (0.0, 0.5), torch.float8_e4m3fn: (2 ** -4, 2 ** -10), torch.float8_e5m2: (2 ** -3, 2 ** -17)}


def write(states, cache, scales, slots, block_size):
    slot_mapping = torch.tensor(slots)
    write_quantized(states, cache, scales, True, slot_mapping, plan_write(slot_mapping, block_size))


def read(cache, scales, block_size, num_kv_heads, head_dim):
    return dequantize(cache, scales, torch.float64).view(-1, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_round_trip_of_a_block_filled_over_several_steps(dtype):
    """A prompt, then tokens one by one that grow past the first scale (requantizing the block): every value
    read back is within the format's bound of what was written."""
    torch.manual_seed(0)
    block_size, heads, dim = 8, 3, 16
    cache = torch.zeros(4, block_size, heads, dim, dtype=dtype)
    scales = torch.zeros(4, heads)
    table = [2, 0]
    tokens = torch.randn(14, heads, dim, dtype=torch.float64)
    tokens[5:] *= torch.linspace(1.5, 40, 9, dtype=torch.float64)[:, None, None]  # later tokens: larger values
    tokens[6, 1] = 0.0  # an all-zero head vector
    slots = [table[p // block_size] * block_size + p % block_size for p in range(14)]
    write(tokens[:5], cache, scales, slots[:5], block_size)  # the prompt
    history = [scales.clone()]
    for p in range(5, 14):  # decode steps
        write(tokens[p:p + 1], cache, scales, slots[p:p + 1], block_size)
        history.append(scales.clone())
    stored = read(cache, scales, block_size, heads, dim)[slots]
    relative, absolute = BOUNDS[dtype]
    block_of_token = [table[p // block_size] for p in range(14)]
    history = torch.stack(history)  # [steps, blocks, heads]: each (block, head) was rounded once per scale it had
    roundings = 1 + ((history[1:] != history[:-1]) & (history[:-1] != 0)).sum(0)
    roundings = roundings[block_of_token][:, :, None]  # [14, heads, 1]
    final_scale = scales[block_of_token][:, :, None].double()
    error = (stored - tokens).abs()
    bound = roundings * (relative * tokens.abs() * (1 + relative) ** roundings + absolute * final_scale)
    assert (error <= bound + 1e-12).all(), (error - bound).max()
    assert roundings.max() > 2  # the test did grow scales
    assert (stored[6, 1] == 0).all()
    # the scale of each (block, head) is at least its largest value over the format's range
    assert (scales[2] * QMAX[dtype] >= tokens[:8].abs().amax((0, 2)) * (1 - 1e-6)).all()


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_a_write_at_a_blocks_first_slot_starts_it_afresh(dtype):
    """A freed block keeps its old scale; the next request that writes it from its first slot must not inherit
    it (a larger old scale would waste the format's range on the new values)."""
    block_size, heads, dim = 4, 2, 16
    cache = torch.zeros(2, block_size, heads, dim, dtype=dtype)
    scales = torch.zeros(2, heads)
    write(torch.full((4, heads, dim), 1000.0), cache, scales, [4, 5, 6, 7], block_size)
    small = torch.randn(2, heads, dim)
    write(small, cache, scales, [4, 5], block_size)
    assert torch.allclose(scales[1], small.abs().amax((0, 2)) / QMAX[dtype])
    # a write past the first slot keeps (and may grow) the scale of what the block already holds
    write(torch.full((1, heads, dim), 0.01), cache, scales, [6], block_size)
    assert torch.allclose(scales[1], small.abs().amax((0, 2)) / QMAX[dtype])


def quantized_batch(kernel, shapes, *, num_heads, num_kv_heads, head_dim, block_size, kv_dtype, dtype, seed):
    """Requests with (cached, new) tokens on scattered blocks: the past is written by one earlier step, the new
    tokens by this one; returns what the kernel attends and what dense attention over the cache's dequantized
    K/V gives."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-(past + new) // block_size) for past, new in shapes) + 4
    permutation = torch.randperm(num_blocks).tolist()
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
    value_cache = torch.zeros_like(key_cache)
    scales = KVScales.create(num_blocks, num_kv_heads, "cpu")
    tables, starts, lens, past_slots, new_slots, past_kv, new_kv = [], [0], [], [], [], [], []
    for past, new in shapes:
        table = [permutation.pop() for _ in range(-(-(past + new) // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(past + new)]
        kv = torch.randn(2, past + new, num_kv_heads, head_dim) * (0.2 + torch.rand(num_kv_heads, 1))  # heads differ
        past_slots += slots[:past]
        new_slots += slots[past:]
        past_kv.append(kv[:, :past]), new_kv.append(kv[:, past:])
        tables.append(table), lens.append(past + new), starts.append(starts[-1] + new)
    for kvs, slots in ((past_kv, past_slots), (new_kv, new_slots)):  # two steps: the past, then the new tokens
        metadata = AttentionMetadata(block_size, starts, lens, tables, torch.tensor(slots))
        plan = kernel.plan(metadata, torch.device("cpu"))
        k, v = torch.cat(kvs, dim=1).to(dtype)
        kernel.write_kv(k, v, key_cache, value_cache, plan, scales)
    query = torch.randn(num_heads, starts[-1], head_dim, dtype=dtype).transpose(0, 1)
    out = kernel.attend(query, k, v, key_cache, value_cache, plan, scaling=head_dim ** -0.5, sliding_window=None,
                        softcap=None, scales=scales)
    # [num_slots, num_kv_heads, head_dim]: what the kernel may read (a bf16 model's kernel rounds them to bf16)
    keys = dequantize(key_cache, scales.key, dtype).double().flatten(0, 1)
    values = dequantize(value_cache, scales.value, dtype).double().flatten(0, 1)
    expected = torch.empty_like(out, dtype=torch.float64)
    for i, table in enumerate(tables):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(lens[i])]
        rows = slice(starts[i], starts[i + 1])
        expected[rows] = dense_reference(query[rows].double(), keys[slots], values[slots], head_dim ** -0.5, None, None)
    return out, expected


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kernel_name", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_paged_attention_matches_dense_over_dequantized_values(kernel_name, kv_dtype, dtype):
    shapes = [(0, 9), (6, 1), (0, 1), (13, 5), (21, 1), (40, 1), (7, 1)]
    kernel = TorchKernel() if kernel_name == "torch" else CpuKernel(dtype, [32], kv_dtype)
    out, expected = quantized_batch(kernel, shapes, num_heads=6, num_kv_heads=2, head_dim=32, block_size=4,
                                    kv_dtype=kv_dtype, dtype=dtype, seed=1)
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3  # float32 arithmetic; bf16: one rounding of the output
    torch.testing.assert_close(out, expected.to(dtype), rtol=tolerance, atol=tolerance)


def test_kernel_selection_with_a_quantized_cache():
    for kv_dtype in KV_DTYPES:  # the compiled kernel reads every quantized cache, whatever the model's dtype
        assert isinstance(select_kernel("auto", specs(torch.float32, [64], kv_dtype)), CpuKernel)
        assert isinstance(select_kernel("auto", specs(torch.bfloat16, [16], kv_dtype)), CpuKernel)
    assert type(select_kernel("auto", specs(torch.float32, [24], torch.int8))) is TorchKernel
    with pytest.raises(ValueError, match="int8/fp8 cache or one in the model's dtype"):
        select_kernel("cpu", specs(torch.float32, [64], torch.float16))
