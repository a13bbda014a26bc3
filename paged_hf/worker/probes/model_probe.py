"""What a model's attention layers are, read off one short forward of the model itself.

Configs name heads and dims in many ways (and a tensor-parallel shard holds only some heads); the model's own
calls never lie. One forward of two tokens runs with a `DynamicCache` whose `update` records each call (the
cache slot, K and V shapes, the device) and an attention function that records what each layer hands it
(attention sinks, its sliding window). Each layer's mask pattern comes from the config's layer types, as
transformers builds its masks: a sliding window must also reach the attention call (where the paged kernels
apply it), a chunked layer (Llama 4) is masked by chunk. A hybrid model's linear-attention, SSM and convolution
layers are read off the same cache after the forward: their states' shapes (worker/hybrid/recurrent_state.py). Models
the engine cannot page are refused here, naming why: cache layers of a kind of their own, sparse indexed
attention, no cache at all, a window only the mask knows.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.cache_utils import (
    DynamicCache,
    DummyLayer,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from paged_hf.integrations.transformers import eager_attention
from paged_hf.kernels.spec import AttentionSpec
from paged_hf.loader.pipeline_stage import absent_layers, stage_of
from paged_hf.worker.attention_switch import AttentionSwitch
from paged_hf.worker.families.registry import FamilyStandIns, cache_class_for, read_own_state_layers, refusal
from paged_hf.worker.hybrid.recurrent_state import StateLayer, read_state_layers

PROBE_ATTENTION = "paged_hf_probe"


class UnsupportedModelError(ValueError):
    """The engine cannot compute this model's forward exactly: refused at `wrap()`, never served differently."""


def model_name(model: torch.nn.Module) -> str:
    return type(model).__name__


@torch.inference_mode()
def probe_layers(model: torch.nn.Module, config, device: torch.device) -> tuple[list[AttentionSpec], list[StateLayer]]:
    """-> one AttentionSpec per layer that writes K/V, in layer order, and one StateLayer per hybrid layer that
    keeps a recurrent state. UnsupportedModelError for what cannot be paged."""
    reason = refusal(model, config)
    if reason is not None:
        raise UnsupportedModelError(reason)
    cache = _probe_cache(model, config)
    records = _Records(model, cache)
    AttentionInterface.register(PROBE_ATTENTION, records.attention)
    # the mask the model's own implementation builds (a model's code may need it: MPT casts it, DeepSeek-V3.2 slices
    # it), as a tensor: eager's or sdpa's (flex attention's block masks and flash attention's are no tensors)
    own_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(getattr(config, "_attn_implementation", None) or "sdpa")
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_ATTENTION, own_mask if own_mask is eager_mask else sdpa_mask)
    stand_ins = FamilyStandIns(model, config)
    _check_indexers(model, cache, stand_ins)
    try:
        with AttentionSwitch(model, PROBE_ATTENTION), stand_ins:
            output = model(**_probe_inputs(model, config, device), cache=cache, use_cache=True)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own error, named in the refusal
        raise UnsupportedModelError(f"{model_name(model)}: its forward fails with its attention switched to another "
                                    f"implementation ({type(exc).__name__}: {exc}); a model that computes attention "
                                    "with its own code is not served") from exc
    finally:  # transformers' registry is global: left there, the records would keep this model alive (a dropped
        AttentionInterface.register(PROBE_ATTENTION, eager_attention)  # engine's weights stayed until the next probe)
    returned = _returned_cache(output)
    own_state_layers = read_own_state_layers(model)  # states kept outside the cache (RecurrentGemma's, RWKV's)
    if returned is not cache and not (returned is None and own_state_layers):
        raise UnsupportedModelError(f"{model_name(model)} does not keep its K/V in the transformers cache it is "
                                    "given (own cache code or none)")
    state_layers = read_state_layers(cache) + own_state_layers
    without_kv = {i for i, layer in enumerate(cache.layers) if isinstance(layer, DummyLayer)}  # MLP-only layers
    without_kv |= absent_layers(model)  # a pipeline stage's: other stages hold them
    layers = _layers(model, records.updates, {layer.layer_idx for layer in state_layers} | without_kv)
    declared = stand_ins.score_terms()  # terms that stand-ins add to layers whose own code passes none
    layers = [dataclasses.replace(layer, indexer_dim=records.indexers.get(layer.layer_idx),
                                  sliding_window=records.windows.get(layer.layer_idx),
                                  score_terms=records.terms(layer.layer_idx) | declared.get(layer.layer_idx, set()))
              for layer in layers]
    if not stand_ins.sites:  # (older families window in their own code, which their stand-ins pass on)
        layers = _apply_mask_patterns(model, config, layers, records.windows)
    return layers, state_layers


class _Records:
    """What the probe's forward writes to its cache and hands its attention function, per cache layer: the cache's
    `update` and `update_indexer` and the attention function (PROBE_ATTENTION) record as they go."""

    def __init__(self, model: torch.nn.Module, cache: DynamicCache):
        self.model = model
        self.updates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # cache layer -> (key, value) written
        self.returned: dict[int, int] = {}  # id of the key update() returned -> its layer
        self._keep: list[torch.Tensor] = []  # those keys, alive while their ids are looked up
        self.sinks: set[int] = set()  # layers whose attention call passes sinks (`s_aux`)
        self.biased: set[int] = set()  # layers whose attention call passes a `position_bias`
        self.windows: dict[int, int | None] = {}  # cache layer -> the sliding_window its attention call passed
        self.indexers: dict[int, int] = {}  # cache layer -> the dim of the indexer keys it keeps
        self._update, self._update_indexer = cache.update, getattr(cache, "update_indexer", None)
        cache.update = self.update
        if self._update_indexer is not None:
            cache.update_indexer = self.update_indexer

    def update(self, key, value, layer_idx, *args, **kwargs):
        if layer_idx in self.updates:
            raise UnsupportedModelError(f"{model_name(self.model)} writes cache layer {layer_idx} twice in one forward")
        self.updates[layer_idx] = (key, value)
        result = self._update(key, value, layer_idx, *args, **kwargs)
        self.returned[id(result[0])] = layer_idx
        self._keep.append(result[0])
        return result

    def terms(self, layer_idx: int) -> frozenset[str]:
        """The ScoreTerms the layer's calls carry, as its own code shows them: sinks, a bias (Inkling's by
        distance), an indexer's selection of keys."""
        return frozenset(name for name, present in (("sinks", layer_idx in self.sinks),
                                                    ("distance_bias", layer_idx in self.biased),
                                                    ("key_mask", layer_idx in self.indexers)) if present)

    def update_indexer(self, keys, layer_idx, *args, **kwargs):
        self.indexers[layer_idx] = keys.shape[-1]
        return self._update_indexer(keys, layer_idx, *args, **kwargs)

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                  s_aux=None, **kwargs):  # sliding_window stays in kwargs: eager_attention masks by the mask
        if id(key) in self.returned:
            layer = self.returned[id(key)]
            self.windows[layer] = kwargs.get("sliding_window")
            if s_aux is not None:
                self.sinks.add(layer)
            if kwargs.get("position_bias") is not None:
                self.biased.add(layer)
        return eager_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, s_aux)


def _probe_inputs(model: torch.nn.Module, config, device: torch.device) -> dict:
    """Two tokens; a pipeline stage after the first takes hidden states (it has no embeddings)."""
    stage = stage_of(model)
    if stage is None or stage.is_first:
        return {"input_ids": torch.zeros(1, 2, dtype=torch.long, device=device)}
    return {"inputs_embeds": torch.zeros(1, 2, config.hidden_size, dtype=model.dtype, device=device)}


def own_cache_class(model: torch.nn.Module) -> type[DynamicCache] | None:
    """The cache class a model's forward insists on, where its modeling module defines one (MiniMax's
    `MiniMaxCache`, which keeps its lightning attention's states beside the K/V layers; for xLSTM's `xLSTMCache`,
    no DynamicCache, the class a family has to answer its forward's reads: families/registry.py); None else."""
    module = sys.modules.get(type(model).__module__)
    for value in vars(module).values() if module is not None else ():
        if isinstance(value, type) and issubclass(value, DynamicCache) and value.__module__ == module.__name__:
            return value
        if isinstance(value, type) and value.__module__ == module.__name__ and cache_class_for(value) is not None:
            return cache_class_for(value)
    return None


def _probe_cache(model: torch.nn.Module, config) -> DynamicCache:
    """The model's own dynamic cache for its config; refuses layers that hold anything but per-token K/V."""
    own = own_cache_class(model)
    if own is not None:
        return own()
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - a config transformers cannot lay out: layers are then added as written
        return DynamicCache()
    kinds = {type(layer).__name__ for layer in cache.layers  # a DummyLayer reuses another's K/V (Gemma 3n)
             if not isinstance(layer, (DynamicLayer, DummyLayer, LinearAttentionCacheLayerMixin))}
    if kinds:
        raise UnsupportedModelError(f"{model_name(model)} has cache layers of kind {', '.join(sorted(kinds))} "
                                    f"({_kinds_reason(kinds)}); paged_hf serves models whose every layer keeps "
                                    "per-token K/V")
    return cache


def _check_indexers(model, cache: DynamicCache, stand_ins: FamilyStandIns) -> None:
    """Sparse attention whose indexer's selection no stand-in applies (worker/families/indexed.py) is refused."""
    indexed = sorted(type(layer).__name__ for layer in cache.layers if hasattr(layer, "update_indexer"))
    if indexed and not stand_ins.selects_keys():
        raise UnsupportedModelError(f"{model_name(model)} uses indexed sparse attention ({indexed[0]}), "
                                    "which the paged kernels do not compute")


def _kinds_reason(kinds: set[str]) -> str:
    return "a cache layout of its own"


def _layers(model, updates: dict, without_kv: set[int]) -> list[AttentionSpec]:
    """`without_kv`: layers that write no K/V by design (recurrent layers, MLP-only layers, K/V reused)."""
    if not updates and not without_kv:
        raise UnsupportedModelError(f"{model_name(model)} wrote no K/V to the cache: its attention does not use "
                                    "transformers' cache")
    missing = sorted(set(range(max(updates, default=-1) + 1)) - set(updates) - without_kv)
    if missing:
        raise UnsupportedModelError(f"{model_name(model)} leaves cache layers {missing} unwritten")
    layers = []
    for index in sorted(updates):
        key, value = updates[index]  # [1, num_kv_heads, num_tokens, head_dim]
        if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
            raise UnsupportedModelError(f"{model_name(model)} writes K {tuple(key.shape)} and V {tuple(value.shape)} "
                                        f"to cache layer {index}: not [batch, kv_heads, tokens, head_dim] pairs")
        layers.append(AttentionSpec(index, key.shape[1], key.shape[-1], value.shape[-1], key.device, key.dtype))
    return layers


def _apply_mask_patterns(model, config, layers: list[AttentionSpec],
                         windows: dict[int, int | None]) -> list[AttentionSpec]:
    """Each layer's mask as transformers would build it (the config's layer types), checked against what its
    attention call passes: the paged kernels window by the call, so a window only the mask knows is refused. The
    layers come back with their chunks (Llama 4's chunked layers are masked by chunk)."""
    try:
        types, per_layer = get_layer_types_and_kwargs(config)
    except Exception:  # noqa: BLE001 - a config without per-layer patterns: the calls' windows are all there is
        return layers
    if any(layer.layer_idx >= len(types) for layer in layers):
        return layers  # cache slots that are not decoder layers (recurrent stacks): the calls' windows are all there is
    checked = []
    for layer in layers:
        index, kind, kwargs = layer.layer_idx, types[layer.layer_idx], per_layer[layer.layer_idx]
        kind = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}.get(kind, kind)
        window = kwargs.get("sliding_window") if kind == "sliding_attention" else None
        passed = windows.get(index)
        if kind == "chunked_attention":
            layer = dataclasses.replace(layer, chunk_size=kwargs["sliding_window"])
        if passed != window and not (kind == "chunked_attention" and passed is None):
            raise UnsupportedModelError(
                f"{model_name(model)} layer {index} is {kind.replace('_', ' ')}"
                + (f" over {window} tokens" if window else "") + f" in its mask, but its attention call passes "
                f"sliding_window={passed}: the paged kernels window by the call")
        checked.append(layer)
    return checked


def _returned_cache(output):
    """The cache a forward returned: `cache` (transformers >= 5.2x), else `past_key_values` (older; asking a newer
    output for it logs a deprecation warning, so it is asked only when `cache` is absent)."""
    if not hasattr(output, "get"):
        return None
    returned = output.get("cache")
    return returned if returned is not None else output.get("past_key_values")

