"""Falcon. Before transformers 5.25 its attention is computed inline: the rotary variants' stand-in is its
forward with the attention through the interface (own_code.py); from 5.25 it calls the interface itself and needs
none. Its ALiBi variants add their ALiBi (slopes rounded to bf16) to the attention mask, which a paged step does
not pass: refused, naming why."""

from __future__ import annotations

import sys

import torch

from paged_hf.worker.families.base import Family, Recognised
from paged_hf.worker.families.own_code import call_interface, computes_attention_inline
from paged_hf.worker.stand_ins import StandIn, modeling_global


class FalconPagedAttention(StandIn):
    """FalconAttention's inline forward (rotary variants) with its attention through the interface."""

    def __init__(self, original: torch.nn.Module, config):
        super().__init__(original)
        object.__setattr__(self, "model_config", config)

    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        attention = self.original  # (ALiBi variants are refused: `_refusal`)
        batch_size, query_length = hidden_states.shape[:2]
        num_kv_heads = attention.num_heads if attention.new_decoder_architecture else attention.num_kv_heads
        query, key, value = attention._split_heads(attention.query_key_value(hidden_states))
        query = query.transpose(1, 2).reshape(batch_size, attention.num_heads, query_length, attention.head_dim)
        key = key.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, attention.head_dim)
        value = value.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, attention.head_dim)
        rotary = modeling_global(attention, "apply_rotary_pos_emb")
        query, key = rotary(query, key, *position_embeddings)
        if layer_past is not None:
            key, value = layer_past.update(key, value, attention.layer_idx)
        output = call_interface(attention, self.model_config, query, key, value, attention_mask,
                                attention.head_dim ** -0.5, None)
        output = output.reshape(batch_size, query_length, attention.num_heads * attention.head_dim)
        return attention.dense(output), None


def _refusal(model: torch.nn.Module, config) -> str | None:
    """A term the model adds to its attention mask reaches no paged kernel (a step passes no mask)."""
    module = sys.modules.get(type(model).__module__)
    if getattr(config, "alibi", False) is True and "build_alibi_tensor" in vars(module or object):
        return (f"{type(model).__name__} with ALiBi: its ALiBi is built into its attention mask, which a paged step "
                "does not pass")
    return None


FAMILY = Family(
    name="falcon",
    serves="Falcon: inline attention before transformers 5.25 (rotary variants); ALiBi variants refused",
    stand_ins=(Recognised("transformers.models.falcon.modeling_falcon:FalconAttention",
                          lambda module, config, model: FalconPagedAttention(module, config),
                          computes_attention_inline),),
    refusal=_refusal,
)
