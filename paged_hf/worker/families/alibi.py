"""ALiBi attention (BLOOM, MPT) in a paged step.

Both add a per-head slope times each key's position to the scores, computed by their own inline code from a
tensor their model builds over the positions of one contiguous sequence (BLOOM from its 2-D attention mask, which
a step does not pass). Softmax does not change when a query's scores all move by one number, so `slope * key
position` equals `-slope * (query position - key position)`: the stand-ins compute the module's projections and
cache write and hand the paged cache the slopes (`ScoreTerms.alibi_slopes`: the torch kernel adds `-slope * distance`,
kernels/torch_kernel.py). During a step BLOOM's model builds no ALiBi tensor (`step_overrides`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_hf.integrations.transformers import UnservedAttention, step_cache
from paged_hf.kernels.spec import ScoreTerms
from paged_hf.worker.families.base import Family, Recognised
from paged_hf.worker.stand_ins import StandIn, modeling_global


class BloomAttention(StandIn):
    """BloomAttention's forward in a step; its own forward outside steps."""

    score_terms = frozenset({"alibi_slopes"})  # what its calls add to the scores (kernels/spec.py)

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        object.__setattr__(self, "slopes", modeling_global(original, "_get_alibi_slopes")(original.num_heads, "cpu"))

    def forward(self, hidden_states, residual, alibi=None, attention_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        attention = self.original
        if layer_past is None or layer_past is not step_cache():
            return attention(hidden_states, residual, alibi, attention_mask, layer_past, use_cache, output_attentions,
                             **kwargs)
        if attention.training:
            raise UnservedAttention("BloomAttention is in training mode (attention dropout)")
        query, key, value = attention._reshape(attention.query_key_value(hidden_states))
        key, value = layer_past.update(key, value, attention.layer_idx)
        output = layer_past.attend(attention, query, key, value, scaling=attention.inv_norm_factor,
                                   sliding_window=None, softcap=None, terms=ScoreTerms(alibi_slopes=self.slopes))
        output = output.reshape(*hidden_states.shape[:-1], -1)
        if attention.pretraining_tp > 1 and attention.slow_but_exact:  # its own sum over the dense's slices
            width, weight = attention.hidden_size // attention.pretraining_tp, attention.dense.weight
            dense = sum(F.linear(output[..., i * width:(i + 1) * width], weight[:, i * width:(i + 1) * width])
                        for i in range(attention.pretraining_tp))
        else:
            dense = attention.dense(output)
        return modeling_global(attention, "dropout_add")(dense, residual, attention.hidden_dropout, False), None


class MptAttention(StandIn):
    """MptAttention's forward in a step; its own forward outside steps. Its slopes are its model's own function's
    (`build_mpt_alibi_tensor`, whose last-but-one column over two positions is `-slope`)."""

    score_terms = frozenset({"alibi_slopes"})  # what its calls add to the scores (kernels/spec.py)

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        build = modeling_global(original, "build_mpt_alibi_tensor")
        object.__setattr__(self, "slopes", -build(original.n_heads, 2)[:, 0, 0].float())

    def forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None, **kwargs):
        attention = self.original
        if cache is None or cache is not step_cache():
            return attention(hidden_states, position_bias, cache, attention_mask, **kwargs)
        if attention.training:
            raise UnservedAttention("MptAttention is in training mode (attention dropout)")
        qkv = attention.Wqkv(hidden_states)
        if attention.clip_qkv:
            qkv = qkv.clamp(min=-attention.clip_qkv, max=attention.clip_qkv)
        shape = (*hidden_states.shape[:-1], attention.n_heads, attention.head_dim)
        query, key, value = (part.reshape(shape).transpose(1, 2) for part in qkv.chunk(3, dim=2))
        key, value = cache.update(key, value, attention.layer_idx)
        output = cache.attend(attention, query, key, value, scaling=attention.softmax_scale, sliding_window=None,
                              softcap=None, terms=ScoreTerms(alibi_slopes=self.slopes))
        return attention.out_proj(output.reshape(*hidden_states.shape[:-1], -1)), None


def step_overrides(model: torch.nn.Module) -> list[tuple[object, str, object]]:
    """(object, attribute, value) set for the duration of a step: BLOOM's model builds its ALiBi tensor from the
    attention mask, which a step does not pass (its stand-ins take the slopes instead)."""
    bloom_model = Recognised(f"{BLOOM}:BloomModel", None)
    return [(module, "build_alibi_tensor", _no_alibi) for module in model.modules() if bloom_model.recognises(module)]


def _no_alibi(*args, **kwargs) -> None:
    return None


BLOOM = "transformers.models.bloom.modeling_bloom"
FAMILY = Family(
    name="alibi",
    serves="BLOOM, MPT: ALiBi computed inline, its slopes handed to the torch kernel",
    stand_ins=(Recognised(f"{BLOOM}:BloomAttention", lambda module, config, model: BloomAttention(module)),
               Recognised("transformers.models.mpt.modeling_mpt:MptAttention",
                          lambda module, config, model: MptAttention(module))),
    step_overrides=step_overrides,
)
