"""Inkling's and Inkling 2's attention in a paged step.

Each query token adds a learned logit per backward distance to its scores (`position_bias`), which their forward
builds densely over the positions a contiguous cache reports; a packed row has no such positions. The stand-ins
compute what the module computes and hand the paged cache the per-token table itself (`ScoreTerms.distance_bias`:
the torch kernel adds each entry by the key's distance, kernels/torch_kernel.py), with Inkling 2's sinks, one
logit per query token and head. Their short convolutions go through the recurrent mixers as any hybrid's (each K and V
projection convolves its own tokens with a state per request). Inkling 2 also attends across depth, over the
states of its earlier blocks at one position (`BlockAttentionResidual`, `MessageAttentionResidual`): no cache,
no sequence; those calls keep the attention function the model had when it was wrapped.
"""

from __future__ import annotations

import inspect

import torch

from paged_hf.integrations.transformers import step_cache
from paged_hf.kernels.spec import ScoreTerms
from paged_hf.worker.families.base import Family, Recognised
from paged_hf.worker.stand_ins import StandIn


class InklingAttention(StandIn):
    """InklingAttention's forward in a step; its own forward outside steps (the probe). Its full-attention layers
    scale queries and table by each token's own position (`log_scaling`)."""

    score_terms = frozenset({"distance_bias"})

    def forward(self, hidden_states, attention_mask=None, conv_mask=None, cache=None, **kwargs):
        attention = self.original
        if cache is None or cache is not step_cache():
            return attention(hidden_states, attention_mask, conv_mask=conv_mask, cache=cache, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attention.head_dim)
        query = attention.q_proj(hidden_states)
        key = attention.k_sconv(attention.k_proj(hidden_states), cache=cache, conv_mask=conv_mask)
        value = attention.v_sconv(attention.v_proj(hidden_states), cache=cache, conv_mask=conv_mask)
        query = attention.q_norm(query.view(hidden_shape)).transpose(1, 2)
        key = attention.k_norm(key.view(hidden_shape)).transpose(1, 2)
        value = value.view(hidden_shape).transpose(1, 2)
        key, value = cache.update(key, value, attention.layer_idx)
        relative = attention.r_proj(hidden_states).view(*input_shape, attention.num_heads, -1)
        table = (relative @ attention.rel_logits_proj.proj)[0]  # [num_tokens, num_heads, extent]
        config = attention.config
        if not attention.is_sliding and config.log_scaling_n_floor is not None:  # in float32, as its own
            positions = step_positions(cache.metadata, hidden_states.device)
            tau = 1.0 + config.log_scaling_alpha * torch.log(
                ((positions + 1).float() / config.log_scaling_n_floor).clamp(min=1.0))
            query = (query.float() * tau.view(1, 1, -1, 1)).to(query.dtype)
            table = (table.float() * tau.view(-1, 1, 1)).to(table.dtype)
        output = cache.attend(attention, query, key, value, scaling=attention.scaling,
                              sliding_window=attention.sliding_window, softcap=None,
                              terms=ScoreTerms(distance_bias=table))
        return attention.o_proj(output.reshape(*input_shape, -1)), None


class Inkling2Attention(StandIn):
    """Inkling 2's sliding and full attention (and its looped model's) in a step: queries, keys and values from
    their own projections (keys and values from their own inputs in the full layers, into the cache layer
    `layer_idx + cache_offset` in a later pass of the loop), the bias table and the sinks per token."""

    score_terms = frozenset({"distance_bias", "sinks"})

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        object.__setattr__(self, "signature", inspect.signature(type(original).forward))  # read once, bound per call

    def forward(self, *args, **kwargs):
        attention = self.original
        call = self.signature.bind(attention, *args, **kwargs).arguments
        cache, options = call.get("cache"), call.get("kwargs", {})
        if cache is None or cache is not step_cache():
            return attention(*args, **kwargs)
        hidden_states, offset, positions = call["hidden_states"], call.get("cache_offset", 0), options["position_ids"]
        key_input = call.get("key_hidden_states")
        value_input = call.get("value_hidden_states")
        projection = dict(cache=cache, conv_mask=call.get("conv_mask"), cache_offset=offset, **options)
        query = attention.q_proj(hidden_states, positions)
        key = attention.k_proj(hidden_states if key_input is None else key_input, **projection)
        value = attention.v_proj(hidden_states if value_input is None else value_input, **projection)
        key, value = cache.update(key, value, attention.layer_idx + offset)
        bias = attention.relative_position_bias
        relative = bias.linear(hidden_states).view(*hidden_states.shape[:-1], bias.num_heads, -1)
        table = (bias.norm(relative, positions) @ bias.proj)[0]  # [num_tokens, num_heads, extent]
        sinks = attention.sink_proj(hidden_states)[0]  # [num_tokens, num_heads]
        output = cache.attend(attention, query, key, value, scaling=attention.scaling,
                              sliding_window=attention.sliding_window, softcap=None,
                              terms=ScoreTerms(sinks=sinks, distance_bias=table))
        return attention.o_proj(output.reshape(*hidden_states.shape[:-1], -1), hidden_states), None


class AcrossDepth(StandIn):
    """An attention over a position's block states (no cache, no sequence): its own forward with the attention
    function its config named when the model was wrapped, not the paged one a step switches the model to."""

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        object.__setattr__(self, "config", _Implementation(original.config, original.config._attn_implementation))

    def forward(self, *args, **kwargs):
        return type(self.original).forward(self, *args, **kwargs)


class _Implementation:
    """A config that names `implementation` as its attention implementation, and is `config` otherwise."""

    def __init__(self, config, implementation: str):
        self._config, self._attn_implementation = config, implementation

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def step_positions(metadata, device: torch.device) -> torch.Tensor:
    """[num_tokens] each token's position in its sequence: a query of n tokens ends at its context length."""
    return torch.cat([torch.arange(end - length, end, device=device)
                      for end, length in zip(metadata.context_lens, metadata.query_lens)])


def _models(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


def _rules(model_type: str, stand_ins: dict[str, type]) -> tuple[Recognised, ...]:
    return tuple(Recognised(f"{_models(model_type)}:{name}", lambda module, config, model, cls=cls: cls(module))
                 for name, cls in stand_ins.items())


FAMILY = Family(
    name="inkling",
    serves="Inkling, Inkling 2: a learned bias by distance and per-token sinks in the scores, attention across depth",
    stand_ins=(*_rules("inkling", {"InklingAttention": InklingAttention}),
               *_rules("inkling2", {"Inkling2SlidingAttention": Inkling2Attention,
                                    "Inkling2FullAttention": Inkling2Attention,
                                    "Inkling2BlockAttentionResidual": AcrossDepth}),
               *_rules("inkling2_loop", {"Inkling2LoopSlidingAttention": Inkling2Attention,
                                         "Inkling2LoopFullAttention": Inkling2Attention,
                                         "Inkling2LoopBlockAttentionResidual": AcrossDepth,
                                         "Inkling2LoopMessageAttentionResidual": AcrossDepth})),
)
