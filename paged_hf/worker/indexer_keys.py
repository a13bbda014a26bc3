"""A sparse-attention indexer's keys, paged like the K/V.

DeepSeek-V3.2-style indexers (Qwen4-Exp's) score each query against one small key per past token, kept beside
the K/V (`cache.update_indexer`, transformers' `DynamicIndexedLayer`), and attend only the tokens they select.
Here those keys live in the K/V's own blocks, `[num_blocks, block_size, dim]` per indexed layer: a request's
block table finds them, copy-on-write copies them with the K/V, and freeing a block frees them too.
"""

from __future__ import annotations

import torch

from paged_hf.utils import cdiv


class IndexerKeys:
    def __init__(self, dims: dict[int, tuple[int, torch.device]], num_blocks: int, block_size: int,
                 dtype: torch.dtype):
        """dims: indexed layer -> (key dim, device)."""
        self.block_size = block_size
        self.keys = {layer: torch.zeros(num_blocks, block_size, dim, dtype=dtype, device=device)
                     for layer, (dim, device) in dims.items()}

    def write(self, layer_idx: int, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """keys [num_tokens, dim] to flat slots (block * block_size + offset)."""
        store = self.keys[layer_idx]
        store.view(-1, store.shape[-1]).index_copy_(0, slots.to(store.device), keys.to(store.dtype))

    def read(self, layer_idx: int, block_table: list[int], length: int) -> torch.Tensor:
        """A request's first `length` keys, [length, dim]."""
        store = self.keys[layer_idx]
        blocks = torch.tensor(block_table[: cdiv(length, self.block_size)], dtype=torch.long, device=store.device)
        return store.index_select(0, blocks).flatten(0, 1)[:length]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for store in self.keys.values():
            store.index_copy_(0, dst.to(store.device), store.index_select(0, src.to(store.device)))
