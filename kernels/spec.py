"""What an attention kernel is asked to compute: one `AttentionSpec` per attention layer, read off the model once
(paged_hf/worker/probes/model_probe.py), and the `ScoreTerms` some layers add to their scores, one object per
call from the model's code through the paged cache to the kernel.

A kernel serves a model when it serves every layer's spec (`unsupported_reason(spec)`: None, or why not); the
torch kernel serves them all. A family feature a kernel must know of is a field of the spec (or a name in its
`score_terms`) and code in the kernels that compute it, never a keyword through the layers in between.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """One slot of the paged cache: what one `cache.update(key, value, layer_idx)` writes and its attention reads."""
    layer_idx: int
    num_kv_heads: int
    head_dim: int  # of the keys
    value_head_dim: int  # of the values (narrower than the keys' in MLA)
    device: torch.device
    dtype: torch.dtype  # the model's: of the queries, keys and values the layer computes
    kv_dtype: torch.dtype | None = None  # the cache's storage when it differs (int8/fp8); None: `dtype`
    sliding_window: int | None = None  # a query sees this many keys back (its own included)
    chunk_size: int | None = None  # a query sees the keys of its own chunk of positions only (Llama 4)
    score_terms: frozenset[str] = frozenset()  # the ScoreTerms fields the layer's calls carry
    indexer_dim: int | None = None  # a sparse-attention indexer's key per token beside the K/V (`update_indexer`)
    # a step may name spans of positions whose tokens all see each other (Gemma 3's images): a query also sees the
    # later keys of its own span, in full and windowed layers alike (the step's `AttentionMetadata.bidirectional`)
    bidirectional_spans: bool = False

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


@dataclass(frozen=True)
class ScoreTerms:
    """What some models add to each query token's scores beyond the causal, window and chunk masks (None: absent).
    - sinks: [num_heads] (gpt-oss's `s_aux`) or [num_tokens, num_heads] (Inkling 2: each query token's own), a
      logit in the softmax whose weight is dropped;
    - distance_bias: [num_tokens, num_heads, extent], a logit each query token adds to the key `d` positions before
      it, for 0 <= d < extent (Inkling's learned relative bias);
    - alibi_slopes: [num_heads], ALiBi's `-slope * d` for the key `d` positions back (BLOOM, MPT);
    - key_mask: [num_tokens, width] bool, the key positions each query token may attend (an indexer's selection,
      sparse attention; positions at or past `width` are not selected)."""
    sinks: torch.Tensor | None = None
    distance_bias: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None

    @property
    def names(self) -> frozenset[str]:
        """The terms present (an AttentionSpec's `score_terms` names them)."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) is not None)

    @property
    def none(self) -> bool:
        return self.sinks is None and not self.per_query

    @property
    def per_query(self) -> bool:
        """Some term differs by query token (everything but per-head sinks): worked out per call of the kernel."""
        return (self.distance_bias is not None or self.alibi_slopes is not None or self.key_mask is not None
                or (self.sinks is not None and self.sinks.dim() == 2))


NO_TERMS = ScoreTerms()
SCORE_TERM_NAMES = frozenset(f.name for f in fields(ScoreTerms))
