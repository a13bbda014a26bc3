"""Recurrent layers that keep their states outside the transformers cache: on their own modules, or in a list the
model's forward hands from layer to layer.

- RecurrentGemma (Griffin): its attention layers write the cache they are given, while each recurrent block keeps
  its convolution's last inputs (`conv1d_state`) and its RG-LRU's state (`rg_lru.recurrent_states`) as attributes
  of its modules, one row per batch row (`ModuleAttributes`).
- RWKV: no cache at all; the model's forward builds five tensors [batch, hidden, layers] and each block reads and
  writes its own column (the attention's and the feed-forward's token shifts, the WKV numerator, denominator and
  running maximum) (`StateArgument`).
- xLSTM: each block takes its mLSTM's states (the matrix memory C, the normalizer n, the running maximum m) as its
  second argument and returns the new ones beside its output; the model's forward reads them from its own
  `xLSTMCache.rnn_state` (`StatePair`; the paged cache answers those reads: `RnnStateCache`).

The engine keeps these states in its state slots like any hybrid's (worker/hybrid/recurrent_state.py) and, around each
call of the block's own forward (worker/hybrid/recurrent_mixers.py), hands the call's rows to the block the way its own
code reads them and takes them back after it. A fresh prompt starts from the block's own initial state. The
blocks are found by their code (`FAMILY`, asked through worker/families/registry.py); their layer index is their
`layer_id`, else their decoder layer's.
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache

from paged_hf.worker.families.base import Family, Recognised
from paged_hf.worker.hybrid.recurrent_state import StateLayer, StateView


class ModuleAttributes:
    """A block whose states are attributes of its modules (RecurrentGemma's recurrent block): the convolution
    state (conv state 0) and the RG-LRU's (recurrent state 0); None on the block makes it start from zeros."""

    paths = ("conv1d_state", "rg_lru.recurrent_states")
    batches = True  # its one-token path takes a batch of sequences

    def __init__(self, block: torch.nn.Module, layer_idx: int):
        self.block, self.layer_idx = block, layer_idx

    def state_layer(self) -> StateLayer | None:
        """After one forward of a single sequence: the states' shapes, then cleared (the model keeps none)."""
        conv, recurrent = (_get(self.block, path) for path in self.paths)
        self._set(None, None)
        if not isinstance(conv, torch.Tensor) or not isinstance(recurrent, torch.Tensor):
            return None
        return StateLayer(self.layer_idx, conv.device, [(tuple(conv.shape[1:]), conv.dtype)],
                          [(tuple(recurrent.shape[1:]), recurrent.dtype)])

    def load(self, view: StateView, args: list, kwargs: dict) -> None:
        self._set(view.get_conv_state(self.layer_idx), view.get_recurrent_state(self.layer_idx))

    def store(self, view: StateView, output) -> None:
        conv, recurrent = (_get(self.block, path) for path in self.paths)
        view.put_conv_state(conv, self.layer_idx)
        view.update_recurrent_state(recurrent, self.layer_idx)
        self._set(None, None)

    def _set(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
        for path, value in zip(self.paths, (conv, recurrent)):
            owner_path, _, name = path.rpartition(".")
            setattr(self.block.get_submodule(owner_path) if owner_path else self.block, name, value)


class StateArgument:
    """A block that reads and writes its column of the `state` list its forward is given (RWKV's: five tensors
    [batch, hidden, layers]; the last three in float32, the running maximum starting at -1e30). The call gets
    tensors whose every column is the call's rows of this layer (stride 0 along the layers), so the block's
    reads and writes of its own column land in them. Its one-token path broadcasts a batch of B sequences to
    B x B rows (the token shift it reads is [B, hidden], the hidden states [B, 1, hidden]; transformers' own
    batched generate has the same fault), so each sequence is a call of its own."""

    batches = False

    def __init__(self, block: torch.nn.Module, layer_idx: int):
        self.block, self.layer_idx = block, layer_idx
        self._state: list[torch.Tensor] = []

    def state_layer(self) -> StateLayer:
        hidden, dtype = self.block.ln1.normalized_shape[0], self.block.ln1.weight.dtype
        dtypes = (dtype, dtype, torch.float32, torch.float32, torch.float32)
        return StateLayer(self.layer_idx, self.block.ln1.weight.device, [],
                          [((hidden,), state_dtype) for state_dtype in dtypes])

    def load(self, view: StateView, args: list, kwargs: dict) -> None:
        """The call's rows (the view's: the block's in-place writes go to them, and `store` puts them back), a
        fresh prompt's the model's initial state; as `layer_idx + 1` columns, of which the block reads its own."""
        batch = (args[0] if args else kwargs["hidden"]).shape[0]
        rows = []
        for index in range(5):
            row = view.get_recurrent_state(self.layer_idx, index)
            if row is None:  # a fresh prompt
                pool = view.states.recurrent[self.layer_idx][index]
                row = torch.full((batch, *pool.shape[1:]), -1e30 if index == 4 else 0.0, dtype=pool.dtype,
                                 device=pool.device)
            rows.append(row)
        self._state = rows
        kwargs["state"] = [row[..., None].expand(*row.shape, self.layer_idx + 1) for row in rows]
        kwargs["use_cache"] = True  # else the block does not write its WKV state back

    def store(self, view: StateView, output) -> None:
        for index, row in enumerate(self._state):
            view.update_recurrent_state(row, self.layer_idx, index)
        self._state = []


class StatePair:
    """A block called as `block(hidden, state) -> (hidden, state)`, `state` a tuple of per-sequence tensors or None
    (xLSTM's: C [heads, qk, v], n [heads, qk], m [heads, 1]), kept in the model's dtype, as transformers' own
    cache keeps them. A fresh prompt starts from zeros, as transformers' generate does (its cache starts zeroed)."""

    batches = True

    def __init__(self, block: torch.nn.Module, layer_idx: int):
        self.block, self.layer_idx = block, layer_idx

    def state_layer(self) -> StateLayer:
        config = self.block.config
        heads, qk, v = config.num_heads, config.qk_head_dim, config.v_head_dim
        weight = self.block.norm_mlstm.weight
        return StateLayer(self.layer_idx, weight.device, [],
                          [((heads, qk, v), weight.dtype), ((heads, qk), weight.dtype), ((heads, 1), weight.dtype)])

    def load(self, view: StateView, args: list, kwargs: dict) -> None:
        batch = (args[0] if args else kwargs["x"]).shape[0]
        state = []
        for index, pool in enumerate(view.states.recurrent[self.layer_idx]):
            row = view.get_recurrent_state(self.layer_idx, index)
            state.append(pool.new_zeros(batch, *pool.shape[1:]) if row is None else row)
        kwargs.pop("state", None)
        del args[1:]
        args.append(tuple(state))

    def store(self, view: StateView, output) -> None:
        for index, state in enumerate(output[1]):
            view.update_recurrent_state(state, self.layer_idx, index)


class RnnStateCache(DynamicCache):
    """The reads a model whose forward keeps its blocks' states in `cache.rnn_state` (xLSTM's) makes of its cache:
    no layer's state (each block's keeper hands it its rows) and a sequence offset nothing reads back. The paged
    cache, which holds no attention layers for such a model, is empty (falsy), so the model writes nothing back."""

    class _NoStates(dict):
        def __missing__(self, layer_idx: int) -> None:
            return None

    rnn_state = _NoStates()

    @property
    def seqlen_offset(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.long)

    @seqlen_offset.setter
    def seqlen_offset(self, value: torch.Tensor) -> None:
        pass  # positions come from the step


class UncutRows:
    """xLSTM's forward cuts an input longer than its config's `max_inference_chunksize` into pieces, each through
    every block, which would cut a step's packed row in the middle of a request: within a step the limit is lifted
    (the engine's token budget bounds a step; the recurrence is the same math cut or not)."""

    def __init__(self, model: torch.nn.Module):
        config = getattr(model, "config", None)
        self.config = config if hasattr(config, "max_inference_chunksize") else None
        self._limit = None

    def __enter__(self) -> None:
        if self.config is not None:
            self._limit, self.config.max_inference_chunksize = self.config.max_inference_chunksize, sys.maxsize

    def __exit__(self, *exc) -> None:
        if self.config is not None:
            self.config.max_inference_chunksize = self._limit


OwnStates = ModuleAttributes | StateArgument | StatePair


def _keeper(reference: str, keeper: type[OwnStates]) -> Recognised:
    return Recognised(f"transformers.models.{reference}", keeper)


FAMILY = Family(
    name="own_states",
    serves="RecurrentGemma, RWKV, xLSTM: recurrent states kept on modules or handed between layers, not in the cache",
    state_keepers=(_keeper("recurrent_gemma.modeling_recurrent_gemma:RecurrentGemmaRecurrentBlock", ModuleAttributes),
                   _keeper("rwkv.modeling_rwkv:RwkvBlock", StateArgument),
                   _keeper("xlstm.modeling_xlstm:xLSTMBlock", StatePair)),
    cache_classes=(Recognised("transformers.models.xlstm.modeling_xlstm:xLSTMCache", RnnStateCache),),
)


def _get(module: torch.nn.Module, path: str):
    owner_path, _, name = path.rpartition(".")
    return getattr(module.get_submodule(owner_path) if owner_path else module, name, None)
