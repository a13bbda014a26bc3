"""Llama's decoder layer over its fused parts (fused_layers.py), and the decoder stack of a model whose forward is
LlamaModel's, which the lean path computes in one compiled call (lean_layers.py, native_layer.py).

A stack computed at its first layer hands its output on through its later layers: LlamaModel's forward gives each
layer the output of the one before it and runs nothing between them, so each later layer is given exactly the
stack's output and returns it (`LeanDecodes.pass_on`). Anything that would see a layer's own output (a hook on a
layer, a global module hook) or a layer not swapped in this step makes every layer go its own way.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module
from transformers.models.llama.modeling_llama import LlamaModel

from paged_hf.kernels import layer_ops
from paged_hf.worker.code_match import runs_forward_of
from paged_hf.worker.fast_paths.lean_layers import LeanDecodes
from paged_hf.worker.stand_ins import StandIn


class FusedDecoderLayer(StandIn):
    """LlamaDecoderLayer's forward over its fused parts, called directly (no module dispatch between them), with
    the residual add after the attention and the norm after it as one compiled op. Where a part is not its fused
    stand-in this step (a LoRA wrapper, a hook), the layer's own forward runs."""

    def __init__(self, layer: torch.nn.Module, parts: dict[str, torch.nn.Module], lean: LeanDecodes):
        super().__init__(layer)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "parts", parts)  # name -> the fused stand-in installed there in a step
        object.__setattr__(self, "lean", lean)  # a step of the decode kernel's, in fewer calls (lean_layers.py)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        passed = self.lean.pass_on(self, hidden_states)  # a later layer of a stack computed in one call
        if passed is not None:
            return passed
        layer, parts = self.layer, self.parts
        if any(layer._modules[name] is not part for name, part in parts.items()) or "past_key_values" in kwargs:
            return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                       cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
                                       **kwargs)
        attention_kwargs = dict(kwargs, position_ids=position_ids, use_cache=use_cache)  # what the attention gets
        lean = self.lean.run(self, hidden_states, position_embeddings, attention_mask, cache, attention_kwargs)
        if lean is not None:
            return lean
        hidden = parts["input_layernorm"].forward(hidden_states)
        hidden, _ = parts["self_attn"].forward(hidden, position_embeddings, attention_mask, cache, **attention_kwargs)
        norm = parts["post_attention_layernorm"].norm
        fused = layer_ops.add_rms_norm(hidden_states, hidden, norm.weight, norm.variance_epsilon)
        if fused is None:
            residual = hidden_states + hidden
            hidden = parts["post_attention_layernorm"].forward(residual)
        else:
            residual, hidden = fused
        return residual + parts["mlp"].forward(hidden)


class DecoderStack:
    """The decoder layers of a model whose forward is LlamaModel's (each layer's output the next one's input,
    nothing between them), every one a fused stand-in: the stack the lean path computes in one compiled call at its
    first layer (lean_layers.py), where this step each layer can be."""

    def __init__(self, owner: torch.nn.Module, modules: dict, layers: list[FusedDecoderLayer]):
        self.owner, self.modules, self.layers = owner, modules, layers
        self.names = list(modules)
        self._installed_in: object | None = None  # the call whose earlier step found them installed

    def installed(self, settled: object | None = None) -> bool:
        """Every layer's stand-in and its parts are in place this step, the model runs all of them, and no hook
        would see a layer's own output (none on the stand-ins, no global module hook). A later step of the call
        whose token `settled` is (not None) takes what an earlier one found: its swaps put the same stand-ins at
        the same places (worker/call_scope.py)."""
        if settled is not None and settled is self._installed_in:
            return True
        installed = self._check_installed()
        self._installed_in = settled if installed else None
        return installed

    def _check_installed(self) -> bool:
        if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or self.owner.config.num_hidden_layers != len(self.layers)):
            return False
        modules = self.modules
        for name, layer in zip(self.names, self.layers):
            if (modules.get(name) is not layer or layer._forward_hooks or layer._forward_pre_hooks
                    or any(layer.layer._modules[part_name] is not part for part_name, part in layer.parts.items())):
                return False
        return True


def decoder_stacks(model: torch.nn.Module, sites: list) -> dict:
    """first layer's stand-in -> DecoderStack, for each module of `model` whose forward is LlamaModel's and whose
    `layers` (all of them run: `config.num_hidden_layers`) all have a FusedDecoderLayer among `sites`."""
    layers = {(id(parent), name): stand_in for parent, name, _, stand_in in sites
              if isinstance(stand_in, FusedDecoderLayer)}
    stacks = {}
    for owner in model.modules():
        layer_list = owner._modules.get("layers") if runs_forward_of(owner, LlamaModel) else None
        if isinstance(layer_list, torch.nn.ModuleList) and len(layer_list) == owner.config.num_hidden_layers > 0:
            stand_ins = [layers.get((id(layer_list), name)) for name in layer_list._modules]
            if all(stand_ins):
                stacks[stand_ins[0]] = DecoderStack(owner, layer_list._modules, stand_ins)
    return stacks
