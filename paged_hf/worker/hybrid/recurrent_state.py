"""A hybrid model's recurrent states: one slot per running request for every linear-attention, SSM and
convolution layer, beside the paged K/V of its attention layers.

transformers' hybrid layers keep, per sequence, convolution states `[channels, kernel]` and recurrent states
(SSM or linear-attention matrices), read and written through `cache.get_conv_state`, `update_conv_state`,
`get_recurrent_state` and `update_recurrent_state` (cache_utils' `LinearAttentionLayer`). Here those states live
in one tensor per layer and state, `[num_slots, *state shape]`, and a `StateView` gives a mixer call the rows of
the requests it computes, with the same semantics as transformers' layer: a request without a previous state
(a fresh prompt) reads None and has its first convolution inputs padded, a continuing one (a later prompt
chunk, a decode) reads and extends its own state. The slots' indices come from the scheduler
(core/state_slots.py); the model's own layer code does the math (worker/hybrid/recurrent_mixers.py calls it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from paged_hf.integrations.transformers import UnservedAttention


@dataclass
class StateLayer:
    """The states of one hybrid layer, per state index: (shape without the batch dim, dtype) or None."""
    layer_idx: int
    device: torch.device
    conv: list[tuple[tuple[int, ...], torch.dtype] | None] = field(default_factory=list)
    recurrent: list[tuple[tuple[int, ...], torch.dtype] | None] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        """Of one slot."""
        sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                 for shape, dtype in (s for s in self.conv + self.recurrent if s is not None)]
        return sum(sizes)


def read_state_layers(cache) -> list[StateLayer]:
    """The state layers of a transformers cache after one forward of a single sequence."""
    layers = []
    for layer_idx, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        states = StateLayer(layer_idx, torch.device(layer.device) if layer.device is not None else torch.device("cpu"))
        for i in range(layer.number_of_states):
            conv = layer.conv_states[i] if layer.is_conv_states_initialized[i] else None
            recurrent = layer.recurrent_states[i] if layer.is_recurrent_states_initialized[i] else None
            states.conv.append(None if conv is None else (tuple(conv.shape[1:]), conv.dtype))
            states.recurrent.append(None if recurrent is None else (tuple(recurrent.shape[1:]), recurrent.dtype))
        layers.append(states)
    for layer_idx, state in enumerate(getattr(cache, "linear_cache", ())):  # MiniMax's own cache: one state each
        if isinstance(state, torch.Tensor):
            layers.append(StateLayer(layer_idx, state.device, [None], [(tuple(state.shape[1:]), state.dtype)]))
    return layers


class RecurrentStates:
    """The slots' tensors: `conv[layer_idx][state_idx]`, `recurrent[layer_idx][state_idx]`, each
    [num_slots, *state shape] (None where the layer has no such state)."""

    def __init__(self, layers: list[StateLayer], num_slots: int):
        self.num_slots = num_slots
        self.conv = {layer.layer_idx: [_slots(s, num_slots, layer.device) for s in layer.conv] for layer in layers}
        self.recurrent = {layer.layer_idx: [_slots(s, num_slots, layer.device) for s in layer.recurrent]
                          for layer in layers}

    @property
    def layer_indices(self) -> set[int]:
        return set(self.conv)

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Slot src -> slot dst in every state (forked children start from their parent's state)."""
        if not copies:
            return
        src, dst = (torch.tensor(side, dtype=torch.long) for side in zip(*copies))
        for states in (*self.conv.values(), *self.recurrent.values()):
            for tensor in states:
                if tensor is not None:
                    tensor.index_copy_(0, dst.to(tensor.device), tensor.index_select(0, src.to(tensor.device)))


def _slots(state: tuple[tuple[int, ...], torch.dtype] | None, num_slots: int, device) -> torch.Tensor | None:
    return None if state is None else torch.zeros(num_slots, *state[0], dtype=state[1], device=device)


class StateView:
    """What one mixer call sees of the cache: the states of its requests' slots (`slots`: [batch] of the call's
    batch rows), all continuing (a previous state to read) or all fresh. The call's in-place updates of a gathered
    state (a decode's convolution update) are written back by `write_back`."""

    def __init__(self, states: RecurrentStates, slots: list[int], continuing: bool):
        self.states, self.continuing = states, continuing
        self.slots = slots
        self._runs = _runs(slots)  # (first slot, count) of each stretch of consecutive slots, in the call's order
        self._gathered: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pool tensor, its gathered rows)

    # --- transformers.Cache's state API, as LinearAttentionLayer implements it -------------------------------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._read(self._tensor(self.states.conv, layer_idx, state_idx)) if self.continuing else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._read(self._tensor(self.states.recurrent, layer_idx, state_idx)) if self.continuing else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """conv_states: [batch, channels, new tokens] -> the convolution's input with its left context: padded
        to the kernel for a fresh prompt, after the kept state for a continuing one; the last kernel-size
        columns are kept."""
        pool = self._tensor(self.states.conv, layer_idx, state_idx)  # [num_slots, channels, kernel]
        kernel = pool.shape[-1]
        if self.continuing:
            full = torch.cat([self._read(pool), conv_states], dim=-1)
        elif conv_states.shape[-1] < kernel:
            full = torch.nn.functional.pad(conv_states, (kernel - conv_states.shape[-1], 0), value=0)
        else:
            full = conv_states
        self._write(pool, full[..., -kernel:])
        return full

    def put_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0) -> None:
        """The call's convolution states as they are (a block that keeps its own: worker/families/own_states.py)."""
        self._write(self._tensor(self.states.conv, layer_idx, state_idx), conv_states)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        pool = self._tensor(self.states.recurrent, layer_idx, state_idx)
        self._write(pool, recurrent_states)
        return self._read(pool)

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """MiniMax's cache API for its lightning attention's one state."""
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.update_recurrent_state(linear_cache, layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int = 0) -> bool:
        return self.continuing

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """transformers >= 5.25: intermediate states kept for a later `crop` (assisted decoding); none here."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers >= 5.25 counts a layer's tokens on the cache; positions here come from the step."""

    # --- the call's rows ------------------------------------------------------------------------------------
    def write_back(self) -> None:
        """Gathered rows the call changed in place go back to their slots."""
        for pool, rows in self._gathered:
            self._scatter(pool, rows)
        self._gathered = []

    def _tensor(self, kind: dict, layer_idx: int, state_idx: int) -> torch.Tensor:
        states = kind.get(layer_idx)
        tensor = states[state_idx] if states is not None and state_idx < len(states) else None
        if tensor is None:
            raise UnservedAttention(f"layer {layer_idx} uses a state (index {state_idx}) the model's probe did not see")
        return tensor

    def _read(self, pool: torch.Tensor) -> torch.Tensor:
        """The call's rows: a view where its slots are consecutive, else a gathered copy written back after the
        call. Gathered by stretches of consecutive slots: `index_select` on rows of a megabyte (a Gated DeltaNet
        state) copies ~6x slower than `cat` of slices on a CPU."""
        if len(self._runs) == 1:
            first, count = self._runs[0]
            return pool[first: first + count]
        rows = torch.cat([pool[first: first + count] for first, count in self._runs])
        self._gathered.append((pool, rows))
        return rows

    def _write(self, pool: torch.Tensor, values: torch.Tensor) -> None:
        self._gathered = [(p, rows) for p, rows in self._gathered if p is not pool]  # written whole: no write-back
        self._scatter(pool, values)

    def _scatter(self, pool: torch.Tensor, values: torch.Tensor) -> None:
        row = 0
        for first, count in self._runs:
            target, source = pool[first: first + count], values[row: row + count]
            if target.data_ptr() != source.data_ptr():  # else the call's view of the pool: already in place
                target.copy_(source)
            row += count


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for slot in slots:
        if runs and slot == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([slot, 1])
    return [(first, count) for first, count in runs]
