"""Recurrent layers that keep their states on their own modules, not in the transformers cache.

RecurrentGemma (Griffin) is a hybrid whose attention layers write the cache it is given, while each recurrent
block keeps its convolution's last inputs (`conv1d_state`) and its RG-LRU's state (`rg_lru.recurrent_states`) as
attributes of its modules, one row per batch row. The engine keeps those states in its state slots like any
hybrid's (worker/recurrent_state.py: the convolution state as a layer's conv state, the RG-LRU's as its recurrent
one) and, around each call of the block's own forward, puts the call's rows on the modules and takes them back
after it (`ModuleStates`, used by worker/recurrent_mixers.py). A block's fresh prompt starts from no state (the
block zero-fills it, as in HF's own generate); its multi-token path starts from no state, so the engine probe runs
continuing chunks token by token. The layer index of a block is its decoder layer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_hf.worker.recurrent_state import StateLayer, StateView

#: module class name -> the attribute paths of its states: (convolution state, recurrent state)
MODULE_STATES: dict[str, tuple[str, str]] = {
    "RecurrentGemmaRecurrentBlock": ("conv1d_state", "rg_lru.recurrent_states"),
}


def module_state_blocks(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> the module in it that keeps states on itself (MODULE_STATES), for models with any."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    blocks = {}
    for layer_idx, layer in enumerate(layers if isinstance(layers, torch.nn.ModuleList) else ()):
        for module in layer.modules():
            if type(module).__name__ in MODULE_STATES:
                blocks[layer_idx] = module
    return blocks


def read_module_state_layers(model: torch.nn.Module) -> list[StateLayer]:
    """The state layers of the blocks that keep states on themselves, after one forward of a single sequence
    (their attributes then hold one row each), which are then cleared (the user's model keeps none of ours)."""
    layers = []
    for layer_idx, block in module_state_blocks(model).items():
        conv, recurrent = (_get(block, path) for path in MODULE_STATES[type(block).__name__])
        if not isinstance(conv, torch.Tensor) or not isinstance(recurrent, torch.Tensor):
            continue  # this forward kept no state (a pipeline stage's absent layer)
        layers.append(StateLayer(layer_idx, conv.device, [(tuple(conv.shape[1:]), conv.dtype)],
                                 [(tuple(recurrent.shape[1:]), recurrent.dtype)]))
        ModuleStates(block).clear()
    return layers


@dataclass
class ModuleStates:
    """The states of one block that keeps them on itself, as a call's `StateView` gives them."""

    block: torch.nn.Module

    def load(self, view: StateView, layer_idx: int) -> None:
        """The call's rows onto the block: a continuing call's states, or none (the block starts from zeros)."""
        conv = view.get_conv_state(layer_idx)
        recurrent = view.get_recurrent_state(layer_idx)
        self._set(conv, recurrent)

    def store(self, view: StateView, layer_idx: int) -> None:
        """The block's states after the call back into the call's slots; the block keeps none."""
        conv_path, recurrent_path = MODULE_STATES[type(self.block).__name__]
        view.put_conv_state(_get(self.block, conv_path), layer_idx)
        view.update_recurrent_state(_get(self.block, recurrent_path), layer_idx)
        self.clear()

    def clear(self) -> None:
        self._set(None, None)

    def _set(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
        for path, value in zip(MODULE_STATES[type(self.block).__name__], (conv, recurrent)):
            owner_path, _, name = path.rpartition(".")
            setattr(self.block.get_submodule(owner_path) if owner_path else self.block, name, value)


def _get(module: torch.nn.Module, path: str):
    owner_path, _, name = path.rpartition(".")
    return getattr(module.get_submodule(owner_path) if owner_path else module, name, None)
