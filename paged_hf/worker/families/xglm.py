"""XGLM (BART's attention: the query scaled before its product with the keys, a mask whose shape it checks): in a
step the stand-in computes the same with the attention through the paged cache; cross-attention raises. (TrOCR's
is the same, but its positions count the tokens of one contiguous sequence, not the step's: refused.)"""

from __future__ import annotations

from paged_hf.integrations.transformers import UnservedAttention, step_cache
from paged_hf.worker.families.base import Family, Recognised
from paged_hf.worker.families.own_code import computes_attention_inline
from paged_hf.worker.stand_ins import StandIn


class BartStyleAttention(StandIn):
    """XGLM's self-attention in a step; its own forward outside steps."""

    def forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, *args, **kwargs):
        attention = self.original
        if cache is None or cache is not step_cache():
            return attention(hidden_states, key_value_states, cache, attention_mask, *args, **kwargs)
        if key_value_states is not None:
            raise UnservedAttention(f"{type(attention).__name__} as cross-attention: not a paged self-attention")
        shape = (*hidden_states.shape[:-1], attention.num_heads, attention.head_dim)
        query = (attention.q_proj(hidden_states) * attention.scaling).view(shape).transpose(1, 2)
        key = attention.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = attention.v_proj(hidden_states).view(shape).transpose(1, 2)
        key, value = cache.update(key, value, attention.layer_idx)
        output = cache.attend(attention, query, key, value, scaling=1.0, sliding_window=None, softcap=None)
        return attention.out_proj(output.reshape(*hidden_states.shape[:-1], attention.embed_dim)), None


FAMILY = Family(
    name="xglm",
    serves="XGLM: BART's attention (query scaled first), computed over the paged cache",
    stand_ins=(Recognised("transformers.models.xglm.modeling_xglm:XGLMAttention",
                          lambda module, config, model: BartStyleAttention(module), computes_attention_inline),),
)
