"""Which attention function the model's layers call: switched to the paged one for each step, and read back by
the fused attention (`fused_layers`), which calls the function the model's own forward would."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def attention_function(attention: torch.nn.Module, default: Callable) -> Callable:
    """The attention function `attention`'s forward calls now (its config's implementation; `default`: eager)."""
    return ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, default)


class AttentionSwitch:
    """Switches the model to the paged attention function for one forward, and back: outside our steps the
    user's model keeps its own attention implementation (a plain forward is untouched)."""

    def __init__(self, model: torch.nn.Module, name: str):
        configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
        self.configs = list({id(c): c for c in configs}.values())
        self.name = name

    def __enter__(self):
        self.previous = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation = self.name

    def __exit__(self, *exc):
        for c, previous in zip(self.configs, self.previous):
            c._attn_implementation = previous
