"""Llama's rotary embedding at one position, the values its own forward computed for that position kept for the
next step that asks for it again (or, in a decode, the same model's next request at that position).

Why: at one row the rotary tables are five small torch ops, ~0.1 ms of a batch-1 token on the default model once
the weights' read has evicted the interpreter's and torch's code and data from the caches (each op then costs
several times its warm time). The rotary forward of Llama's code (rope types without a dynamic update) is a pure
function of its `inv_freq` buffer, `attention_scaling`, the position and the output dtype, so the kept values are
that forward's own for the position, bit for bit; a step of several positions, another rope type, or a buffer
replaced or changed in place (its version and address) computes them again.
"""

from __future__ import annotations

import torch

from paged_hf.worker.fast_paths.packed_linears import weight_version
from paged_hf.worker.stand_ins import StandIn

#: rope types whose forward updates `inv_freq` with the positions it is given (transformers' `dynamic_rope_update`)
_UPDATING = ("dynamic", "longrope")


def keeps_positions(module: torch.nn.Module) -> bool:
    """A rotary module whose forward (Llama's code, recognised by the caller) changes nothing with the positions."""
    rope_type = getattr(module, "rope_type", None)
    return isinstance(rope_type, str) and not any(kind in rope_type for kind in _UPDATING)


class RotaryTable(StandIn):
    """The rotary module's (cos, sin) at single positions, kept as its forward made them."""

    def __init__(self, rotary: torch.nn.Module):
        super().__init__(rotary)
        object.__setattr__(self, "rotary", rotary)
        self._made_from: tuple | None = None  # (inv_freq, its version and address, attention_scaling, rope_type)
        self._positions: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self.rotary
        if (kwargs or position_ids.shape != (1, 1) or position_ids.device.type != "cpu" or x.device.type != "cpu"
                or not keeps_positions(rotary)):
            return type(rotary).forward(rotary, x, position_ids, **kwargs)
        inv_freq, made = rotary.inv_freq, self._made_from
        made_from = (weight_version(inv_freq), rotary.attention_scaling, rotary.rope_type)
        if made is None or made[0] is not inv_freq or made[1:] != made_from:
            self._made_from, self._positions = (inv_freq, *made_from), {}
        key = (int(position_ids), x.dtype)
        kept = self._positions.get(key)
        if kept is None:
            kept = self._positions[key] = type(rotary).forward(rotary, x, position_ids)
        return kept[0], kept[1]
