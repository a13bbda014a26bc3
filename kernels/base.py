"""The interface every attention kernel implements."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from paged_hf.kernels import layer_ops
from paged_hf.kernels.quant import KVScales, plan_write, write_quantized
from paged_hf.kernels.spec import NO_TERMS, AttentionSpec, ScoreTerms


class AttentionKernel(Protocol):
    name: str

    @staticmethod
    def unsupported_reason(spec: AttentionSpec) -> str | None:
        """None when this kernel computes the layer `spec` describes; else why not (said where it is refused)."""

    def plan(self, metadata, device: torch.device) -> Any:
        """Turn the step's AttentionMetadata into what `write_kv`/`attend` need on `device`. Once per step."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, plan: Any, scales: KVScales | None = None) -> None:
        """key, value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
        `scales`: the layer's scales when the cache is quantized (int8/fp8), else None."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, plan: Any, *, scaling: float, sliding_window: int | None,
               softcap: float | None, scales: KVScales | None = None, chunk_size: int | None = None,
               terms: ScoreTerms = NO_TERMS) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key/value: this step's [num_tokens, num_kv_heads, head_dim]
        (already in the cache; V's head_dim may differ from K's). Returns [num_tokens, num_heads, value head_dim].
        Causal, window and chunk masking are ours; `chunk_size`: a query sees only the keys of its own chunk of
        positions (Llama 4's chunked layers); `terms`: what the layer adds to its scores (spec.ScoreTerms: sinks,
        a bias by distance, ALiBi slopes, a key selection), for the kernels whose `unsupported_reason` admits it."""


def write_kv_by_slots(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, scales: KVScales | None = None, plan: Any = None) -> None:
    """The NHD cache write every kernel shares: token i's K/V go to flat slot slot_mapping[i], so any kernel
    reads what another wrote. A quantized cache (`scales` given) is written through `quant.write_quantized`;
    its per-step bookkeeping is made once and kept on the kernel's `plan` (its `quant_write` field)."""
    if scales is not None:
        if scales.dynamic and plan.quant_write is None:  # fixed scales need no per-block bookkeeping
            plan.quant_write = plan_write(slot_mapping, key_cache.shape[1])
        write_quantized(key, key_cache, scales.key, scales.dynamic, slot_mapping, plan.quant_write)
        write_quantized(value, value_cache, scales.value, scales.dynamic, slot_mapping, plan.quant_write)
        return
    for source, cache in ((key, key_cache), (value, value_cache)):
        if not layer_ops.scatter_rows(source, cache, slot_mapping):  # (one compiled call on CPU)
            cache.view(-1, *cache.shape[-2:]).index_copy_(0, slot_mapping, source)
