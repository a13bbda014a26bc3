"""The interface every attention kernel implements."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class AttentionKernel(Protocol):
    name: str

    def plan(self, metadata, device: torch.device) -> Any:
        """Turn the step's AttentionMetadata into what `write_kv`/`attend` need on `device`. Once per step."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, plan: Any) -> None:
        """key, value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, plan: Any, *, scaling: float, sliding_window: int | None,
               softcap: float | None) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key/value: this step's [num_tokens, num_kv_heads, head_dim]
        (already in the cache). Returns [num_tokens, num_heads, head_dim]. Causal and window masking are ours."""


def write_kv_by_slots(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """The NHD cache write every kernel shares: token i's K/V go to flat slot slot_mapping[i], so any kernel
    reads what another wrote."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
