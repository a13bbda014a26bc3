"""`PagedCache`: a `transformers.Cache` whose K/V live in fixed-size blocks shared by all requests.

Each layer's K/V tensor is `[num_blocks, block_size, num_kv_heads, head_dim]` on that layer's device. The
step's metadata lives here (not in forward kwargs, which accelerate's hooks would copy to every layer's
device again and again): `begin_step` plans once per device, every layer then writes and attends with it.
An int8/fp8 cache (`kv_dtype`) also holds each layer's scales per (block, KV head), `kernels.quant.KVScales`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from paged_hf.kernels.quant import KVScales, as_bytes, is_quantized
from paged_hf.worker.step_inputs import AttentionMetadata


class PagedCache(Cache):
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: list[int], head_dim: list[int],
                 dtype: torch.dtype, devices: list[torch.device], kernel, kv_dtype: torch.dtype | None = None):
        """dtype: the model's; kv_dtype: the cache's storage dtype when it is quantized (int8/fp8)."""
        super().__init__(layers=[])
        kv_dtype = kv_dtype or dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kernel = kernel
        self.layer_devices = [torch.device(d) for d in devices]
        # zeros, not empty: padded decode gathers read unwritten slots (masked, but NaN * 0 would leak)
        self.key_cache = [
            torch.zeros(num_blocks, block_size, h, d, dtype=kv_dtype, device=dev)
            for h, d, dev in zip(num_kv_heads, head_dim, self.layer_devices)
        ]
        self.value_cache = [torch.zeros_like(k) for k in self.key_cache]
        self.scales: list[KVScales | None] = [
            KVScales.create(num_blocks, h, dev, dynamic=kernel.per_block_kv_scales) if is_quantized(kv_dtype) else None
            for h, dev in zip(num_kv_heads, self.layer_devices)
        ]
        self.metadata: AttentionMetadata | None = None
        self._plans: dict[torch.device, object] = {}

    # --- one step -------------------------------------------------------------------------------------
    def begin_step(self, metadata: AttentionMetadata) -> None:
        """Plan the step once per device; every layer on that device reuses the plan."""
        self.metadata = metadata
        self._plans = {device: self.kernel.plan(metadata, device) for device in dict.fromkeys(self.layer_devices)}

    def end_step(self) -> None:
        self.metadata = None
        self._plans = {}

    @property
    def in_step(self) -> bool:
        return self.metadata is not None

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy block src[i] to block dst[i] in every layer's K and V (copy-on-write of shared blocks). All
        sources are read before any destination is written; the destinations are distinct."""
        if not src:
            return
        indices = {}
        for layer, device in enumerate(self.layer_devices):
            if device not in indices:
                indices[device] = (torch.tensor(src, dtype=torch.long, device=device),
                                   torch.tensor(dst, dtype=torch.long, device=device))
            src_index, dst_index = indices[device]
            scales = self.scales[layer]
            caches = (self.key_cache[layer], self.value_cache[layer])  # [num_blocks, block_size, heads, dim]
            for cache in caches + ((scales.key, scales.value) if scales is not None else ()):
                cache = as_bytes(cache)  # fp8 moves as bytes
                cache.index_copy_(0, dst_index, cache.index_select(0, src_index))

    # --- the transformers.Cache protocol ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [1, num_kv_heads, num_tokens, head_dim] (RoPE applied). Written through
        `slot_mapping`; returned unchanged (the attention function reads the cache, not these)."""
        assert self.in_step, "PagedCache.update outside of a paged step"
        plan = self._plans[self.layer_devices[layer_idx]]
        self.kernel.write_kv(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1),
                             self.key_cache[layer_idx], self.value_cache[layer_idx], plan, self.scales[layer_idx])
        return key_states, value_states

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
               scaling: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
        """query: [1, num_heads, num_tokens, head_dim] -> [1, num_tokens, num_heads, head_dim]."""
        output = self.kernel.attend(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
            self.key_cache[layer_idx], self.value_cache[layer_idx], self._plans[self.layer_devices[layer_idx]],
            scaling=scaling, sliding_window=sliding_window, softcap=softcap, scales=self.scales[layer_idx],
        )
        return output.unsqueeze(0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions always come from the step; nothing in the model should ask

    def __len__(self) -> int:
        return len(self.key_cache)

    def __repr__(self) -> str:
        return f"PagedCache(num_layers={len(self)}, num_blocks={self.num_blocks}, block_size={self.block_size})"
