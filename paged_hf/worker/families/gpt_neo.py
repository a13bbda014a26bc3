"""GPT-Neo and GPT-NeoX-Japanese: plain causal softmax attention computed in the module's own `_attn`. Their
stand-in runs the module's own forward with itself as `self`, whose `_attn` is the interface's (own_code.py).
GPT-Neo's local layers attend `window_size` tokens and it does not scale its scores."""

from __future__ import annotations

from paged_hf.worker.families.base import Family, Recognised
from paged_hf.worker.families.own_code import OwnAttnMethod, computes_attention_inline


def _gpt_neo(module, config, model):
    window = config.window_size if module.attention_type == "local" else None
    return OwnAttnMethod(module, config, 1.0, window)


def _gpt_neox_japanese(module, config, model):
    return OwnAttnMethod(module, config, 1.0 / module.norm_factor, None)


FAMILY = Family(
    name="gpt_neo",
    serves="GPT-Neo, GPT-NeoX-Japanese: attention in the module's own _attn, routed through the interface",
    stand_ins=(
        Recognised("transformers.models.gpt_neo.modeling_gpt_neo:GPTNeoSelfAttention", _gpt_neo,
                   computes_attention_inline),
        Recognised("transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese:GPTNeoXJapaneseAttention",
                   _gpt_neox_japanese, computes_attention_inline),
    ),
)
