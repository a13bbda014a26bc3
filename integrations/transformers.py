"""Registers the `"paged_hf"` attention function in transformers' `AttentionInterface`.

Inside a paged step (the model was called with `paged_cache=`), attention runs the selected kernel over
the block tables. Anywhere else (a plain forward or HF's own `generate` of the wrapped model) it is exactly
`sdpa`: the mask interface gets sdpa's mask builder under the same name, so transformers builds the same
mask it would for `sdpa`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION_NAME = "paged_hf"

# A 4D mask makes transformers' mask builders return it unchanged: in a paged step the kernel masks.
STEP_MASK_SENTINEL = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, paged_cache=None, **kwargs):
    if paged_cache is None or not paged_cache.in_step:
        if softcap is not None:  # sdpa cannot soft-cap; the model's own eager path can
            return _eager_with_softcap(module, query, key, value, attention_mask, scaling, dropout, softcap)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    output = paged_cache.attend(module.layer_idx, query, key, value, scaling=scaling,
                                sliding_window=sliding_window, softcap=softcap)
    return output, None


def _eager_with_softcap(module, query, key, value, attention_mask, scaling, dropout, softcap):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def register() -> None:
    """Idempotent: makes `"paged_hf"` a valid `attn_implementation`."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
