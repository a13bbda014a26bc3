"""The paged step's books: which cache layer each attention call serves, and that every layer was served.

Every cache layer is written once a step (`PagedCache.update`) and attended at least once. An attention call is
matched to its layer by the very K/V tensors `update` returned (whatever index the module writes at: recurrent
stacks write at `layer_idx + offset`). A module that attends something else of what it cached gets its layer's
cached K/V transformed the same way, token by token, over the step's gathered blocks (worker/gathered_attention):
- MLA modules (`expand_kv`, transformers' DeepSeek-V2/V3 family) cache a latent and attend its expansion;
- modules that attend a rearrangement of their cached heads (DiffLlama splits V's heads in two, JetMoE tiles
  them): the arrangement is read off this step's tokens, and checked on all of them.
Anything else raises `UnservedAttention`, as does a layer that wrote K/V no attention call read (the model
computes attention with its own code) or one that was never written: the step fails instead of returning
another model's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_hf.integrations.transformers import UnservedAttention

#: [num_blocks, block_size, num_kv_heads, dim] key and value blocks -> what the module attends, in that layout
Transform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class StepBooks:
    def __init__(self, layer_indices: list[int]):
        """layer_indices: the `layer_idx` each cache slot holds, in slot order (a hybrid model's attention layers
        are some of its layers only)."""
        self.layer_indices = layer_indices
        self.slot_of_layer = {layer_idx: slot for slot, layer_idx in enumerate(layer_indices)}
        self.num_layers = len(layer_indices)
        self.begin()

    def begin(self) -> None:
        self.written: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self.attended = [0] * self.num_layers
        self.layer_of_key: dict[int, int] = {}  # id of a key update() returned -> its layer

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> int:
        """-> the cache slot of the layer that writes."""
        layer = self._unwritten(layer_idx)
        self.written[layer] = (key, value)
        self.layer_of_key[id(key)] = layer
        return layer

    def serve(self, layer_idx: int, rows: torch.Tensor) -> int:
        """A layer written and attended in one call, from its fused q/k/v `rows` (worker/fast_paths/lean_layers.py) -> its
        cache slot. Another attention call of the layer then attends K/V that are not what it wrote."""
        layer = self._unwritten(layer_idx)
        self.written[layer] = (rows, rows)
        self.attended[layer] += 1
        return layer

    def _unwritten(self, layer_idx: int) -> int:
        layer = self.slot_of_layer.get(layer_idx)
        if layer is None or self.written[layer] is not None:
            raise UnservedAttention(f"cache layer {layer_idx} is written twice or was not seen when the model was "
                                    f"probed (layers {self.layer_indices})")
        return layer

    def resolve(self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[int, Transform | None]:
        """-> (the cache slot this attention call serves, None when it attends what was cached as cached, else the
        transform of the cached blocks into what it attends)."""
        layer = self.layer_of_key.get(id(key))
        if layer is not None and self.written[layer][0] is key and self.written[layer][1] is value:
            self.attended[layer] += 1
            return layer, None
        layer = self.slot_of_layer.get(getattr(module, "layer_idx", None))
        if layer is None or self.written[layer] is None:
            raise UnservedAttention(f"{type(module).__name__} attends K/V that are not those it wrote to the cache")
        written_key, written_value = self.written[layer]
        if callable(getattr(module, "expand_kv", None)):
            transform = _expansion(module)
        else:
            transform = _rearrangement(module, written_key, written_value, key, value)
        self.attended[layer] += 1
        return layer, transform

    def check(self) -> None:
        """After the forward: every layer was written and attended, through the paged kernels."""
        unattended = [self.layer_indices[i] for i in range(self.num_layers)
                      if self.written[i] is not None and not self.attended[i]]
        unwritten = [self.layer_indices[i] for i in range(self.num_layers) if self.written[i] is None]
        if unattended or unwritten:
            raise UnservedAttention(
                "the paged step was not served by the paged attention: "
                + (f"layers {unattended} wrote K/V that no attention call read (the model computes attention "
                   "with its own code)" if unattended else f"layers {unwritten} were never written"))


def _expansion(module: torch.nn.Module) -> Transform:
    """MLA: the latent (one head, kv_lora_rank) and shared rotary key (one head) expanded by the module's own
    `expand_kv` into per-head K and V."""

    def expand(latent: torch.Tensor, rotary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks, block_size = latent.shape[:2]
        # [1, num_heads, num_blocks * block_size, dim]: every gathered slot expanded (unwritten ones are masked)
        keys, values = module.expand_kv(latent.reshape(1, 1, num_blocks * block_size, -1),
                                        rotary.reshape(1, 1, num_blocks * block_size, -1))
        return _as_blocks(keys, num_blocks, block_size), _as_blocks(values, num_blocks, block_size)

    return expand


def _as_blocks(states: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[1, heads, num_blocks * block_size, dim] -> [num_blocks, block_size, heads, dim], contiguous as a cache."""
    return states[0].transpose(0, 1).contiguous().view(num_blocks, block_size, states.shape[1], -1)


def _rearrangement(module, written_key, written_value, key, value) -> Transform:
    key_heads, value_heads = _head_map(written_key, key), _head_map(written_value, value)
    if key_heads is None or value_heads is None:
        raise UnservedAttention(f"{type(module).__name__} attends K/V that are not those it wrote to the cache, "
                                "nor a rearrangement of their heads")
    return lambda k, v: (k.index_select(2, key_heads), v.index_select(2, value_heads))


def _head_map(written: torch.Tensor, passed: torch.Tensor) -> torch.Tensor | None:
    """Head i of `passed` [1, heads', tokens, dim] is head map[i] of `written` [1, heads, tokens, dim] for every
    token of the step -> map, else None."""
    if passed.shape[0] != 1 or passed.shape[2:] != written.shape[2:]:
        return None
    first_passed, first_written = passed[0, :, 0], written[0, :, 0]  # [heads', dim], [heads, dim]
    matches = (first_passed[:, None, :] == first_written[None, :, :]).all(-1)  # [heads', heads]
    if not bool(matches.any(1).all()):
        return None
    head_map = matches.to(torch.int8).argmax(1)
    return head_map if torch.equal(written[0].index_select(0, head_map), passed[0]) else None
