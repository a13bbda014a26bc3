"""How many KV blocks fit: budgeted per device, after the weights (they are already loaded)."""

from __future__ import annotations

from collections import defaultdict

import torch

from paged_hf.config import PagedConfig
from paged_hf.kernels.quant import is_quantized, storage_dtype
from paged_hf.utils import cdiv
from paged_hf.worker.distributed import min_over_ranks
from paged_hf.worker.model_info import ModelInfo, free_memory_bytes


def bytes_per_block(block_size: int, num_kv_heads: list[int], head_dim: list[int], dtype: torch.dtype) -> int:
    """K and V of every layer in the cache's storage `dtype`; an int8/fp8 cache adds its float32 K and V scale
    per (block, KV head)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    scale_bytes = 2 * 4 if is_quantized(dtype) else 0
    return sum(2 * block_size * h * d * element_size + h * scale_bytes for h, d in zip(num_kv_heads, head_dim))


def num_blocks_from_memory(info: ModelInfo, config: PagedConfig, max_model_len: int) -> int:
    """Block ids are shared by every layer, so the device with the least room per block sets the count.

    `kv_cache_memory`: bytes per device (> 1) or a fraction of each device's free memory; None: half the free
    GPU memory, or on CPU 4 GiB at most a quarter of the available RAM (vLLM's CPU default).
    """
    layers_by_device: dict[torch.device, list[int]] = defaultdict(list)
    for layer, device in enumerate(info.layer_devices):
        layers_by_device[device].append(layer)
    num_blocks = None
    for device, layers in layers_by_device.items():
        budget = config.kv_cache_memory
        if budget is None:
            budget = 0.5 if device.type == "cuda" else min(4 << 30, free_memory_bytes(device) // 4)
        if budget <= 1:
            budget = budget * free_memory_bytes(device)
        per_block = bytes_per_block(config.block_size, [info.num_kv_heads[i] for i in layers],
                                    [info.head_dim[i] for i in layers], storage_dtype(config.kv_cache_dtype, info.dtype))
        fits = int(budget) // per_block
        num_blocks = fits if num_blocks is None else min(num_blocks, fits)
    # no point in more blocks than every sequence at full length can use
    most_useful = config.max_num_seqs * cdiv(max_model_len, config.block_size)
    # tensor parallel: every rank must schedule identically, so all take the smallest pool
    return min_over_ranks(max(1, min(num_blocks, most_useful)))
