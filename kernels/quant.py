"""A quantized KV cache: int8 or fp8 values with one float32 scale per (block, KV head).

Why per (block, KV head): keys of different heads differ in range by orders of magnitude (a few channels carry
large values), so a scale per head is what int8 needs; one per block follows the data as it changes along the
sequence, costs 8 bytes per 16 tokens x head (vs. 2 x 16 x 64 bytes of K/V), and copies with the block (prefix
cache, copy-on-write). A scale per tensor would need calibration ahead of time.

A block is filled over several steps (a prompt, then one token per decode step), so its scale is set by its
first write and grows when a larger value arrives: the block's stored values are then requantized to the new
scale. An fp8 scale grows at least twofold (`MIN_GROWTH`): fp8's relative precision does not depend on the scale,
so headroom is free and fewer requantizations round less. An int8 scale grows to exactly what is needed: int8
has no exponent, and headroom costs more than re-rounding (measured on the default model's K/V: relative RMS
error 1.7% with exact growth, 2.2% with twofold; docs/kv_cache_dtype.md). A write that covers a block's first
slot starts that block afresh (its old content belonged to a freed request).

Kernels that can only take one scale per tensor (FlashInfer) use `dynamic=False`: scales stay 1.0 and values
are clipped to the format's range (vLLM's default for an uncalibrated fp8 cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: PagedConfig.kv_cache_dtype -> the storage dtype ("auto": the model's own dtype, not quantized)
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
KV_CACHE_DTYPE_NAMES = ("auto", *KV_CACHE_DTYPES)
#: the largest magnitude each storage dtype holds: a (block, head)'s largest |value| maps to it
QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
#: a growing scale grows at least this much (fp8: fewer requantizations; int8: headroom would cost precision)
MIN_GROWTH = {torch.float8_e4m3fn: 2.0, torch.float8_e5m2: 2.0, torch.int8: 1.0}
MIN_SCALE = 1e-30  # the scale of an all-zero (block, head): any positive value divides it without overflow


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A quantized tensor's bytes: torch's CPU index_copy_/index_select have no fp8 kernels, bytes move the same."""
    return tensor.view(torch.uint8) if is_quantized(tensor.dtype) else tensor


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES.get(kv_cache_dtype, model_dtype)


@dataclass
class KVScales:
    """One layer's scales: value = stored value * scale of its (block, KV head)."""

    key: torch.Tensor  # [num_blocks, num_kv_heads] float32
    value: torch.Tensor  # [num_blocks, num_kv_heads] float32
    dynamic: bool = True  # False: fixed at 1.0 (kernels that take one scale per tensor)

    @classmethod
    def create(cls, num_blocks: int, num_kv_heads: int, device, dynamic: bool = True) -> "KVScales":
        fill = 0.0 if dynamic else 1.0  # 0: never written
        key = torch.full((num_blocks, num_kv_heads), fill, dtype=torch.float32, device=device)
        return cls(key, key.clone(), dynamic)


@dataclass
class WritePlan:
    """What every layer's write of one step shares (from the slot mapping alone)."""

    blocks: torch.Tensor  # [num_touched] the distinct blocks the step writes
    inverse: torch.Tensor  # [num_tokens] each token's index in `blocks`
    fresh: torch.Tensor  # [num_touched] bool: the step writes the block's first slot, its old content is stale


def plan_write(slot_mapping: torch.Tensor, block_size: int) -> WritePlan:
    blocks, inverse = torch.unique(slot_mapping // block_size, return_inverse=True)
    fresh = torch.zeros(blocks.shape[0], dtype=torch.bool, device=slot_mapping.device)
    fresh[inverse[slot_mapping % block_size == 0]] = True
    return WritePlan(blocks, inverse, fresh)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: values already divided by their scale (float32) -> `dtype`, rounded to nearest, clipped to its range."""
    qmax = QMAX[dtype]
    if dtype == torch.int8:
        return x.round().clamp_(-qmax, qmax).to(dtype)
    return x.clamp(-qmax, qmax).to(dtype)


def dequantize(stored: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """stored: [num_blocks, block_size, num_kv_heads, head_dim]; scales: [num_blocks, num_kv_heads]."""
    return (stored.to(torch.float32) * scales[:, None, :, None]).to(dtype)


def write_quantized(states: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, dynamic: bool,
                    slot_mapping: torch.Tensor, plan: WritePlan) -> None:
    """states: [num_tokens, num_kv_heads, head_dim] -> their slots of `cache` [num_blocks, block_size, heads, dim],
    updating `scales` [num_blocks, heads] of the blocks written (and requantizing a block whose scale grows)."""
    num_kv_heads, head_dim = cache.shape[-2:]
    states = states.to(torch.float32)
    if dynamic:
        # the scale each written (block, head) needs: [num_touched, num_kv_heads]
        needed = states.abs().amax(-1) / QMAX[cache.dtype]
        index = plan.inverse[:, None].expand(-1, num_kv_heads)
        needed = needed.new_zeros(plan.blocks.shape[0], num_kv_heads).scatter_reduce_(0, index, needed, "amax")
        old = scales.index_select(0, plan.blocks).masked_fill_(plan.fresh[:, None], 0.0)
        grows = needed > old
        new = torch.where(grows, torch.maximum(needed, old * MIN_GROWTH[cache.dtype]), old).clamp_min_(MIN_SCALE)
        regrown = grows & (old > 0)
        if bool(regrown.any()):
            _requantize(cache, plan.blocks, regrown.any(1), old / new)
        scales.index_copy_(0, plan.blocks, new)
        states = states / new.index_select(0, plan.inverse)[..., None]  # each token by its (block, head) scale
    stored = quantize(states, cache.dtype)  # not dynamic: the scales stay 1.0
    as_bytes(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_bytes(stored))


def _requantize(cache: torch.Tensor, blocks: torch.Tensor, which: torch.Tensor, ratio: torch.Tensor) -> None:
    """Blocks blocks[which] move to their new scales: stored values times old/new scale (1 where unchanged)."""
    grown = blocks[which]
    values = as_bytes(cache).index_select(0, grown).view(cache.dtype).to(torch.float32) * ratio[which][:, None, :, None]
    as_bytes(cache).index_copy_(0, grown, as_bytes(quantize(values, cache.dtype)))
