"""GIT (GenerativeImage2Text) as a text decoder: its self-attention computes BERT's scaled dot product inline (no
attention interface). In a step the stand-in computes the same through the paged cache; outside steps (the model
probe, a plain forward) the module's own forward runs. Prompts are text only: a step passes no pixel values, so
every token is causal."""

from __future__ import annotations

import math

from paged_hf.integrations.transformers import step_cache
from paged_hf.worker.families.base import Family, Recognised
from paged_hf.worker.families.own_code import computes_attention_inline
from paged_hf.worker.stand_ins import StandIn


class GitSelfAttention(StandIn):
    """GitSelfAttention's forward in a step: q, k, v, the cache write, softmax(q k^T / sqrt(d)) v."""

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        attention = self.original
        if cache is None or cache is not step_cache():
            return attention(hidden_states, attention_mask, cache, **kwargs)
        shape = (*hidden_states.shape[:-1], -1, attention.attention_head_size)
        query = attention.query(hidden_states).view(shape).transpose(1, 2)
        key = attention.key(hidden_states).view(shape).transpose(1, 2)
        value = attention.value(hidden_states).view(shape).transpose(1, 2)
        key, value = cache.update(key, value, attention.layer_idx)
        output = cache.attend(attention, query, key, value, scaling=1 / math.sqrt(attention.attention_head_size),
                              sliding_window=None, softcap=None)
        return output.reshape(*hidden_states.shape[:-1], attention.all_head_size), None


FAMILY = Family(
    name="git",
    serves="GIT as a text decoder: BERT's attention computed inline, over the paged cache",
    stand_ins=(Recognised("transformers.models.git.modeling_git:GitSelfAttention",
                          lambda module, config, model: GitSelfAttention(module), computes_attention_inline),),
)
