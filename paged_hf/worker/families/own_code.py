"""Attention computed inline by a module's own code (older transformers families), routed through the attention
interface: the module's code runs for everything else (projections, rotary, the cache write, the output
projection) and only the attention itself goes to the interface, with the module's scaling and window, so in a
paged step it reaches the paged kernels (the step books would fail it otherwise). Used by gpt_neo.py, falcon.py.
"""

from __future__ import annotations

import torch

from paged_hf.worker.attention_switch import attention_function
from paged_hf.worker.code_match import reads_name
from paged_hf.worker.stand_ins import StandIn


def computes_attention_inline(module: torch.nn.Module) -> bool:
    """Its forward does not call the attention interface itself (once transformers ports a family to the
    interface, its stand-in steps aside: Falcon from 5.25)."""
    return not reads_name(module, "ALL_ATTENTION_FUNCTIONS")


def call_interface(module, config, query, key, value, attention_mask, scaling, window):
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
        output = call_interface(self.original, self.model_config, query, key, value, attention_mask, self.scaling,
                                self.window)
        return output.transpose(1, 2), None  # [batch, heads, tokens, head_dim], as the module's own _attn
