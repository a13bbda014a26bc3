"""Registers the `"paged_hf"` attention function in transformers' `AttentionInterface`.

Inside a paged step (a `PagedCache` entered `step_scope`), attention runs the selected kernel over the block
tables; the cache is found through the step's scope, not a forward keyword, so a decoder layer that drops its
`**kwargs` cannot make a layer miss it. The call is strict: a mask the model built itself, or a keyword whose
math the kernels do not apply, raises `UnservedAttention` instead of being ignored (the engine then refuses the
model). Anywhere else (a plain forward, HF's own `generate` of the wrapped model) it is exactly `sdpa`: the mask
interface gets sdpa's mask builder under the same name, so transformers builds the same mask it would for `sdpa`.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from paged_hf.kernels.spec import ScoreTerms

ATTENTION_NAME = "paged_hf"

# A 4D mask makes transformers' mask builders return it unchanged: in a paged step the kernel masks.
STEP_MASK_SENTINEL = torch.ones(1, 1, 1, 1, dtype=torch.bool)

#: keywords that reach attention functions and carry nothing the paged kernels must apply (their values are
#: positions, flags and bookkeeping the step already has, or checked below); `output_*` flags are harmless too
HARMLESS_KEYWORDS = frozenset({
    "position_ids", "use_cache", "cache_position", "output_attentions", "return_dict", "layer_idx", "head_mask",
    "position_embeddings", "output_hidden_states", "is_causal", "kwargs", "layer_type", "cache",
    "past_key_values", "token_type_ids", "logits_to_keep",
})

_STEP_CACHE: ContextVar = ContextVar("paged_hf_step_cache", default=None)


class UnservedAttention(RuntimeError):
    """An attention call the paged kernels cannot compute as the model defines it."""


@contextlib.contextmanager
def step_scope(cache):
    """The paged cache that attention calls use while the step's forward runs (this thread only)."""
    token = _STEP_CACHE.set(cache)
    try:
        yield
    finally:
        _STEP_CACHE.reset(token)


def step_cache():
    """The paged cache of the step running on this thread, or None outside a paged step."""
    return _STEP_CACHE.get()


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, s_aux=None, indices=None, **kwargs):
    """`indices`: [1, num_tokens, k], the key positions each query token attends (a sparse-attention indexer's,
    in a step: worker/families/indexed.py), -1 for none."""
    cache = _STEP_CACHE.get()
    if cache is None:
        if indices is not None:  # outside a step: the selection as a mask, as the model's own eager/sdpa path does
            attention_mask = with_selection(attention_mask, indices, query.shape[2], key.shape[2])
        if softcap is not None or s_aux is not None:  # sdpa can neither soft-cap nor add sinks; eager can
            return eager_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, s_aux)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    check_step_call(module, attention_mask, dropout, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    terms = ScoreTerms(sinks=s_aux, key_mask=None if indices is None else cache.key_mask_of(indices))
    output = cache.attend(module, query, key, value, scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                          terms=terms)
    return output, None


def selection_mask(indices: torch.Tensor, width: int) -> torch.Tensor:
    """[..., query_len, k] key positions per query (-1: none, as a sparse kernel's `indices`) -> [..., query_len,
    width] bool: the positions selected."""
    columns = torch.where(indices >= 0, indices.long(), width)  # -1 lands in a column that is dropped
    selected = torch.zeros(*indices.shape[:-1], width + 1, dtype=torch.bool, device=indices.device)
    return selected.scatter_(-1, columns, True)[..., :width]


def with_selection(attention_mask, indices: torch.Tensor, query_len: int, key_len: int) -> torch.Tensor:
    """A causal mask (`attention_mask`, or causal when None) restricted to the key positions `indices`
    [batch, query_len, k] selects (-1: none): bool where the mask is bool or None, else additive."""
    selected = selection_mask(indices, key_len).unsqueeze(1)  # [batch, 1, query_len, key_len]
    if attention_mask is None:
        positions = torch.arange(key_len, device=indices.device)
        return selected & (positions[None, :] <= positions[key_len - query_len:, None])
    if attention_mask.dtype == torch.bool:
        return attention_mask & selected
    return attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)


def check_step_call(module, attention_mask, dropout, kwargs) -> None:
    """What a paged step's kernels cannot honour raises (the model is then refused, never served differently)."""
    name = type(module).__name__
    if attention_mask is not None and not (attention_mask.dim() == 4 and attention_mask.numel() == 1):
        raise UnservedAttention(f"{name} builds its own attention mask {tuple(attention_mask.shape)} instead of "
                                "transformers' causal mask")
    if dropout and module.training:
        raise UnservedAttention(f"{name} is in training mode with attention dropout {dropout}")
    if kwargs.get("is_causal") is False:
        raise UnservedAttention(f"{name} attends bidirectionally (is_causal=False)")
    unknown = sorted(k for k, v in kwargs.items()
                     if k not in HARMLESS_KEYWORDS and not k.startswith("output_") and v is not None)
    if unknown:
        raise UnservedAttention(f"{name} passes {', '.join(unknown)} to its attention function, which the paged "
                                "kernels do not apply")


def eager_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, sinks):
    """Attention with soft-capping and/or sinks (a per-head logit in the softmax whose weight is dropped)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    if sinks is not None:  # [num_heads] -> one more column of logits
        sink_column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def register() -> None:
    """Idempotent: makes `"paged_hf"` a valid `attn_implementation`."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
