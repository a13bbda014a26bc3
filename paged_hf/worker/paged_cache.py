"""`PagedCache`: a `transformers.Cache` whose K/V live in fixed-size blocks shared by all requests.

Each layer's K tensor is `[num_blocks, block_size, num_kv_heads, head_dim]` on that layer's device, its V the
same with V's own head_dim (MLA models cache K and V of different widths). The step's metadata lives here (not
in forward kwargs, which accelerate's hooks would copy to every layer's device again and again): `begin_step`
plans once per device, every layer then writes and attends with it.
An int8/fp8 cache (`kv_dtype`) also holds each layer's scales per (block, KV head), `kernels.quant.KVScales`.

The step keeps books (worker/step_books.py): every cache layer is written once and attended, and each attention
call is matched to its layer; a layer that never reaches the paged attention fails the step (`check_step`)
instead of returning another model's tokens. A module that attends its cached K/V transformed (MLA's latent
expanded, heads rearranged) is attended over its gathered, transformed blocks (worker/gathered_attention.py).
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache

from paged_hf.integrations.transformers import UnservedAttention, selection_mask
from paged_hf.kernels.quant import KVScales, as_bytes, is_quantized
from paged_hf.kernels.spec import NO_TERMS, AttentionSpec, ScoreTerms
from paged_hf.profiling import span
from paged_hf.worker.gathered_attention import GatheredAttention
from paged_hf.worker.indexer_keys import IndexerKeys
from paged_hf.worker.hybrid.recurrent_mixers import RecurrentStep
from paged_hf.worker.hybrid.recurrent_state import RecurrentStates
from paged_hf.worker.step_books import StepBooks
from paged_hf.worker.step_inputs import AttentionMetadata


class NoLayerObjects(list):
    """`PagedCache.layers`: empty; a model that indexes it gets a layer that holds nothing (`NoLayer`)."""

    def __getitem__(self, index):
        return NoLayer()


class NoLayer:
    """A layer object of the paged cache: the history of positions a model keeps on one of its layers (Qwen4-Exp's
    `indexer_position_ids`) is always empty, as positions come from the step; anything else a model reads of its
    cache's layers (compressed or indexed attention with cache layers of its own: DeepSeek-V4, MiniMax-M3) is
    refused, saying why."""

    indexer_position_ids = property(lambda self: None, lambda self, value: None)

    def __getattr__(self, name: str):
        raise UnservedAttention("the model reads its cache's layer objects (cache layers of its own, as compressed "
                                f"or indexed attention keeps: `{name}`): not served by the paged cache")


class PagedCache(Cache):
    def __init__(self, num_blocks: int, block_size: int, layers: list[AttentionSpec], dtype: torch.dtype, kernel,
                 kv_dtype: torch.dtype | None = None, states: RecurrentStates | None = None, span_kernel=None):
        """layers: one spec per cache slot (worker.model_probe); dtype: the model's; kv_dtype: the cache's storage
        dtype when it is quantized (int8/fp8); states: a hybrid model's recurrent-state slots; span_kernel: the kernel
        of the steps whose metadata carries bidirectional spans where `kernel` cannot compute them (None: `kernel`)."""
        Cache.__init__(self, layers=NoLayerObjects())  # (not a model's own cache class's __init__)
        kv_dtype = kv_dtype or dtype
        self.model_dtype = dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kernel = kernel
        self.span_kernel = span_kernel
        self.step_kernel = kernel  # the kernel of the running step (`span_kernel` for a step with spans)
        self.attention_layers = layers
        self.layer_devices = [torch.device(layer.device) for layer in layers]
        # zeros, not empty: padded decode gathers read unwritten slots (masked, but NaN * 0 would leak)
        self.key_cache = [
            torch.zeros(num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype=kv_dtype, device=dev)
            for layer, dev in zip(layers, self.layer_devices)
        ]
        self.value_cache = [
            torch.zeros(num_blocks, block_size, layer.num_kv_heads, layer.value_head_dim, dtype=kv_dtype, device=dev)
            for layer, dev in zip(layers, self.layer_devices)
        ]
        self.scales: list[KVScales | None] = [
            KVScales.create(num_blocks, layer.num_kv_heads, dev, dynamic=kernel.per_block_kv_scales)
            if is_quantized(kv_dtype) else None
            for layer, dev in zip(layers, self.layer_devices)
        ]
        self.metadata: AttentionMetadata | None = None
        self._plans: dict[torch.device, object] = {}
        self._decode_rows: dict[tuple[torch.device, int], object] = {}  # the step's (device, head_dim) -> DecodeRows
        self.books = StepBooks([layer.layer_idx for layer in layers])
        self.states = states
        self.indexer_keys = IndexerKeys({layer.layer_idx: (layer.indexer_dim, dev) for layer, dev
                                         in zip(layers, self.layer_devices) if layer.indexer_dim},
                                        num_blocks, block_size, dtype)
        self.recurrent_step: RecurrentStep | None = None  # how the step's row splits for the recurrent mixers
        self.gathered_attention = GatheredAttention()

    # --- one step -------------------------------------------------------------------------------------
    def begin_step(self, metadata: AttentionMetadata) -> None:
        """Plan the step once per device; every layer on that device reuses the plan."""
        self.metadata = metadata
        spans = self.span_kernel is not None and metadata.bidirectional
        self.step_kernel = self.span_kernel if spans else self.kernel
        self._plans = {device: self.step_kernel.plan(metadata, device) for device in dict.fromkeys(self.layer_devices)}
        self._decode_rows = {}
        self.books.begin()
        self.gathered_attention.begin_step()
        if self.states is not None:
            self.recurrent_step = RecurrentStep.of(metadata.query_start_loc, metadata.context_lens,
                                                   metadata.state_slots)

    def check_step(self) -> None:
        """After the forward: every layer was written and attended, through the paged kernels."""
        self.books.check()

    def end_step(self) -> None:
        self.metadata = None
        self.step_kernel = self.kernel
        self._plans = {}
        self._decode_rows = {}
        self.recurrent_step = None
        self.books.begin()  # holds no tensor past the step

    @property
    def in_step(self) -> bool:
        return self.metadata is not None

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy block src[i] to block dst[i] in every layer's K and V (copy-on-write of shared blocks). All
        sources are read before any destination is written; the destinations are distinct."""
        if not src:
            return
        indices = {}
        for layer, device in enumerate(self.layer_devices):
            if device not in indices:
                indices[device] = (torch.tensor(src, dtype=torch.long, device=device),
                                   torch.tensor(dst, dtype=torch.long, device=device))
            src_index, dst_index = indices[device]
            scales = self.scales[layer]
            caches = (self.key_cache[layer], self.value_cache[layer])  # [num_blocks, block_size, heads, dim]
            for cache in caches + ((scales.key, scales.value) if scales is not None else ()):
                cache = as_bytes(cache)  # fp8 moves as bytes
                cache.index_copy_(0, dst_index, cache.index_select(0, src_index))
        if self.indexer_keys.keys:
            self.indexer_keys.copy_blocks(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))

    # --- the transformers.Cache protocol ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [1, num_kv_heads, num_tokens, head_dim] (RoPE applied). Written through
        `slot_mapping`; returned unchanged (the attention function reads the cache, not these)."""
        assert self.in_step, "PagedCache.update outside of a paged step"
        slot = self.books.write(layer_idx, key_states, value_states)
        self._write_rows(slot, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        return key_states, value_states

    def _write_rows(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [num_tokens, kv_heads, dim] into cache slot `slot`'s blocks, through the step's plan."""
        self.step_kernel.write_kv(key, value, self.key_cache[slot], self.value_cache[slot],
                                  self._plans[self.layer_devices[slot]], self.scales[slot])

    def write_and_attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         *, scaling: float) -> torch.Tensor:
        """`update` then `attend` for a module whose q/k/v are rows [num_tokens, heads, dim] (views of the fused
        attention's q/k/v output, worker/fast_paths/fused_layers.py) -> [num_tokens, num_heads, value_head_dim]: the same
        writes and kernel calls without transformers' [1, heads, tokens, dim] layout in between."""
        assert self.in_step, "PagedCache.write_and_attend outside of a paged step"
        slot = self.books.write(module.layer_idx, key, value)
        self._write_rows(slot, key, value)
        with span("attention"):
            layer_idx, transform = self.books.resolve(module, key, value)
            assert layer_idx == slot and transform is None
            return self.step_kernel.attend(query, key, value, self.key_cache[slot], self.value_cache[slot],
                                           self._plans[self.layer_devices[slot]],
                                           scales=self.scales[slot], scaling=scaling, sliding_window=None,
                                           softcap=None, chunk_size=self.attention_layers[slot].chunk_size)

    def decode_rows(self, slot: int):
        """For a step whose every query the CPU kernel's decode call serves, over cache slot `slot`'s unquantized
        CPU blocks: that call on q rows read in place (`CpuKernel.decode_rows`), made once a step for the layers
        alike; None otherwise (their calls go through `write_and_attend`/`attend`)."""
        key_cache = self.key_cache[slot]
        memo = (self.layer_devices[slot], key_cache.shape[3])
        if memo not in self._decode_rows:
            decode_rows = getattr(self.step_kernel, "decode_rows", None)
            usable = (decode_rows is not None and self.in_step and self.scales[slot] is None
                      and self.attention_layers[slot].chunk_size is None and self.layer_devices[slot].type == "cpu")
            self._decode_rows[memo] = decode_rows(self._plans[memo[0]], self.model_dtype, key_cache.dtype,
                                                  key_cache.shape[3]) if usable else None
        return self._decode_rows[memo]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
               scaling: float, sliding_window: int | None, softcap: float | None,
               terms: ScoreTerms = NO_TERMS) -> torch.Tensor:
        """query: [1, num_heads, num_tokens, head_dim] -> [1, num_tokens, num_heads, value_head_dim]; key/value:
        what the module hands its attention function (its layer is found by them, step_books.py); `terms`: what
        the layer adds to its scores (kernels/spec.py), handed to the kernel as they are."""
        with span("attention"):
            layer_idx, transform = self.books.resolve(module, key, value)
            query, key, value = (t[0].transpose(0, 1) for t in (query, key, value))  # [num_tokens, heads, dim]
            masking = dict(scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                           chunk_size=self.attention_layers[layer_idx].chunk_size, terms=terms)
            key_cache, value_cache = self.key_cache[layer_idx], self.value_cache[layer_idx]
            if transform is None:
                output = self.step_kernel.attend(query, key, value, key_cache, value_cache,
                                                 self._plans[self.layer_devices[layer_idx]],
                                                 scales=self.scales[layer_idx], **masking)
            elif self.scales[layer_idx] is not None:
                raise UnservedAttention("an attention of transformed K/V (MLA, rearranged heads) over an int8/fp8 "
                                        "cache")
            else:
                output = self.gathered_attention.attend(transform, query, key, value, key_cache, value_cache,
                                                        self.metadata, **masking)
            return output.unsqueeze(0)

    def key_mask_of(self, selected: torch.Tensor) -> torch.Tensor:
        """selected [1, num_tokens, k]: each query token's key positions (-1: none), as a sparse kernel takes
        them -> [num_tokens, longest context] bool, as `ScoreTerms.key_mask`."""
        return selection_mask(selected[0], max(self.metadata.context_lens))

    def get_conv_state(self, *args, **kwargs):
        raise UnservedAttention("the model keeps a convolution state in its cache: hybrid layers are not paged")

    def get_recurrent_state(self, *args, **kwargs):
        raise UnservedAttention("the model keeps a recurrent state in its cache: hybrid layers are not paged")

    update_conv_state, update_recurrent_state = get_conv_state, get_recurrent_state
    get_linear_cache = set_linear_cache = get_recurrent_state

    def update_indexer(self, *args, **kwargs):
        raise UnservedAttention("the model indexes its cache (sparse attention): not served by the paged kernels")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions always come from the step; nothing in the model should ask

    def __len__(self) -> int:
        return len(self.key_cache)

    def __repr__(self) -> str:
        return f"PagedCache(num_layers={len(self)}, num_blocks={self.num_blocks}, block_size={self.block_size})"


@functools.cache
def paged_cache_class(own: type[Cache] | None) -> type[PagedCache]:
    """PagedCache, or for a model whose forward insists on a cache class of its own (model_probe.own_cache_class)
    one that is both: the paged cache's methods first, so nothing of the own class's storage is ever used."""
    return PagedCache if own is None else type(f"Paged{own.__name__}", (PagedCache, own), {})
