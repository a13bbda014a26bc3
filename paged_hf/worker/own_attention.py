"""Attention modules of older transformers families that compute attention with their own code, routed through
the attention interface for the engine's steps (and the model probe).

GPT-Neo, GPT-NeoX-Japanese and Falcon (rotary) compute plain causal softmax attention inline instead of calling
transformers' `AttentionInterface`, so a paged step would never reach the paged kernels (and the step books
would fail it). Their stand-ins run the module's own code for everything else, projections, rotary, the cache
write, the output projection, and hand only the attention itself to the interface with the module's scaling
and window:
- GPT-Neo and GPT-NeoX-Japanese: the module's own forward runs with the stand-in as `self`, whose `_attn`
  is the interface's (their local layers attend `window_size` tokens, GPT-Neo does not scale its scores);
- Falcon: its forward is short and inline; the stand-in's is the same with the attention through the
  interface (ALiBi variants raise: Falcon builds its ALiBi into its mask, with slopes rounded to bf16);
- Inkling and Inkling 2: a learned logit per query token and backward distance in the scores, per-token sinks
  and attention across depth (worker/inkling_attention.py);
- Qwen4-Exp: sparse attention over the tokens its indexer selects (worker/indexed_attention.py);
- BLOOM and MPT: ALiBi (worker/alibi_attention.py);
- XGLM (BART's attention: query scaled before its product with the keys, a mask whose shape it checks): the
  stand-in's forward is the same with the attention through the paged cache; cross-attention raises. (TrOCR's is
  the same, but its positions count the tokens of one contiguous sequence, not the step's: refused.)
The engine probe checks each against the model's own forward; families not listed keep their own code and are
refused there.
"""

from __future__ import annotations

import torch

from paged_hf.integrations.transformers import UnservedAttention, step_cache
from paged_hf.worker.alibi_attention import alibi_stand_in, step_overrides
from paged_hf.worker.attention_switch import attention_function
from paged_hf.worker.code_match import reads_name
from paged_hf.worker.indexed_attention import indexed_stand_in
from paged_hf.worker.inkling_attention import inkling_stand_in
from paged_hf.worker.packed_linears import ModuleSwaps, StandIn, modeling_global


def _call_interface(module, config, query, key, value, attention_mask, scaling, window):
    """[batch, heads, tokens, head_dim] q/k/v -> [batch, tokens, heads, head_dim] through the attention interface."""
    function = attention_function(_WithConfig(module, config), None)
    output, _ = function(module, query, key, value, attention_mask, scaling=scaling, dropout=0.0,
                         sliding_window=window)
    return output


class _WithConfig:
    """What `attention_function` reads of a module (its config's implementation), for modules without a config."""

    def __init__(self, module, config):
        self.config = getattr(module, "config", None) or config


class OwnAttnMethod(StandIn):
    """`original`'s own forward, with its `_attn(query, key, value, attention_mask)` through the interface."""

    def __init__(self, original: torch.nn.Module, config, scaling: float, window: int | None):
        super().__init__(original)
        object.__setattr__(self, "model_config", config)
        self.scaling, self.window = scaling, window

    def forward(self, *args, **kwargs):
        return type(self.original).forward(self, *args, **kwargs)

    def _attn(self, query, key, value, attention_mask=None, *args, **kwargs):
        output = _call_interface(self.original, self.model_config, query, key, value, attention_mask, self.scaling,
                                 self.window)
        return output.transpose(1, 2), None  # [batch, heads, tokens, head_dim], as the module's own _attn


class FalconPagedAttention(StandIn):
    """FalconAttention's forward (rotary variants; before transformers 5.25, which calls the interface itself) with
    its attention through the interface."""

    def __init__(self, original: torch.nn.Module, config):
        super().__init__(original)
        object.__setattr__(self, "model_config", config)

    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        attention = self.original  # (ALiBi variants are refused by the model probe)
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
        output = _call_interface(attention, self.model_config, query, key, value, attention_mask,
                                 attention.head_dim ** -0.5, None)
        output = output.reshape(batch_size, query_length, attention.num_heads * attention.head_dim)
        return attention.dense(output), None


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


def stand_in_for(module: torch.nn.Module, config, model: torch.nn.Module) -> torch.nn.Module | None:
    """The stand-in of an attention module with its own code, None for any other module."""
    name = type(module).__name__
    if reads_name(module, "ALL_ATTENTION_FUNCTIONS"):  # its code calls the interface itself (Falcon from 5.25)
        return inkling_stand_in(module) or indexed_stand_in(module, model) or alibi_stand_in(module)
    if name == "GPTNeoSelfAttention":
        window = config.window_size if module.attention_type == "local" else None
        return OwnAttnMethod(module, config, 1.0, window)
    if name == "GPTNeoXJapaneseAttention":
        return OwnAttnMethod(module, config, 1.0 / module.norm_factor, None)
    if name == "FalconAttention":
        return FalconPagedAttention(module, config)
    if name == "XGLMAttention":
        return BartStyleAttention(module)
    return inkling_stand_in(module) or indexed_stand_in(module, model) or alibi_stand_in(module)


class OwnAttentions(ModuleSwaps):
    """Every attention module with its own code that has a stand-in here, swapped for it in a step."""

    def __init__(self, model: torch.nn.Module, config):
        self.sites = []
        for parent in model.modules():
            for name, child in parent._modules.items():
                stand_in = stand_in_for(child, config, model) if child is not None else None
                if stand_in is not None:
                    self.sites.append((parent, name, child, stand_in))
        self.overrides = step_overrides(model) if self.sites else []

    def score_terms(self) -> dict[int, frozenset[str]]:
        """cache layer -> the ScoreTerms its stand-in adds to the scores (ALiBi's slopes: the module's own code
        computes them inline, so no attention call of its shows them to the model probe)."""
        return {original.layer_idx: stand_in.score_terms for _, _, original, stand_in in self.sites
                if getattr(stand_in, "score_terms", None) and getattr(original, "layer_idx", None) is not None}

    def __enter__(self) -> None:
        super().__enter__()
        for owner, name, value in self.overrides:
            setattr(owner, name, value)  # an instance attribute over the class's method, for the step

    def __exit__(self, *exc) -> None:
        for owner, name, _ in self.overrides:
            owner.__dict__.pop(name, None)
        super().__exit__(*exc)
