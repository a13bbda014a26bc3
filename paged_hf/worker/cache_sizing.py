"""How many KV blocks fit: budgeted per device, after the weights (they are already loaded)."""

from __future__ import annotations

from collections import defaultdict

import torch

from paged_hf.config import PagedConfig
from paged_hf.kernels.quant import is_quantized, storage_dtype
from paged_hf.utils import cdiv
from paged_hf.worker.distributed import min_over_ranks
from paged_hf.worker.model_info import ModelInfo, free_memory_bytes


def bytes_per_block(block_size: int, num_kv_heads: list[int], head_dim: list[int], dtype: torch.dtype,
                    value_head_dim: list[int] | None = None) -> int:
    """K and V of every layer in the cache's storage `dtype` (V's head_dim: `head_dim` unless given, as MLA's
    differs); an int8/fp8 cache adds its float32 K and V scale per (block, KV head)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    scale_bytes = 2 * 4 if is_quantized(dtype) else 0
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    return sum(block_size * h * (d + v) * element_size + h * scale_bytes
               for h, d, v in zip(num_kv_heads, head_dim, value_head_dim))


def num_blocks_from_memory(info: ModelInfo, config: PagedConfig, max_model_len: int) -> int:
    """Block ids are shared by every layer, so the device with the least room per block sets the count.

    `kv_cache_memory`: bytes per device (> 1) or a fraction of each device's free memory; None: half the free
    GPU memory, or on CPU 4 GiB at most a quarter of the available RAM (vLLM's CPU default). A hybrid model's
    recurrent-state slots (`state_slot_count`, on their layers' devices) come out of the same budget first.
    """
    layers_by_device: dict[torch.device, list[int]] = defaultdict(list)
    for layer, device in enumerate(info.layer_devices):
        layers_by_device[device].append(layer)
    state_bytes: dict[torch.device, int] = defaultdict(int)
    for layer in info.state_layers:
        state_bytes[layer.device] += layer.num_bytes * state_slot_count(config)
    # no point in more blocks than every sequence at full length can use
    most_useful = config.max_num_seqs * cdiv(max_model_len, config.block_size)
    num_blocks = most_useful  # a model without attention layers: blocks only count tokens
    for device in {*layers_by_device, *state_bytes}:
        budget = config.kv_cache_memory
        if budget is None:
            budget = 0.5 if device.type == "cuda" else min(4 << 30, free_memory_bytes(device) // 4)
        if budget <= 1:
            budget = budget * free_memory_bytes(device)
        budget -= state_bytes[device]
        layers = layers_by_device.get(device, [])
        if budget <= 0 and (layers or state_bytes[device]):
            raise ValueError(f"kv_cache_memory leaves no room on {device}: the recurrent states of "
                             f"{state_slot_count(config)} requests take {state_bytes[device] / 2**20:.0f} MiB")
        if not layers:
            continue
        per_block = bytes_per_block(config.block_size, [info.num_kv_heads[i] for i in layers],
                                    [info.head_dim[i] for i in layers], storage_dtype(config.kv_cache_dtype, info.dtype),
                                    [info.value_head_dim[i] for i in layers])
        per_block += sum(config.block_size * (info.attention_layers[i].indexer_dim or 0) for i in layers) * \
            torch.empty((), dtype=info.dtype).element_size()  # sparse attention's indexer keys (indexer_keys.py)
        num_blocks = min(num_blocks, int(budget) // per_block)
    # tensor parallel: every rank must schedule identically, so all take the smallest pool
    return min_over_ranks(max(1, num_blocks))


def state_slot_count(config: PagedConfig) -> int:
    """A hybrid model's recurrent-state slots: one per running request (the engine's probe uses two)."""
    return max(config.max_num_seqs, 2)
