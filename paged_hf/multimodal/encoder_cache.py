"""The engine's encoder-output cache: an image's features (what its vision tower and projector give) kept by the
image's content hash (`family.content_hash`, the hash the prefix cache mixes into its blocks), within a byte limit,
the least recently used dropped first (vLLM's encoder cache).

The prefix cache already skips the vision tower for the same image at the same place behind the same text; this
cache skips it for the same image anywhere: after other text, at another offset, in another request, once the
prefix cache has dropped its blocks. Features bigger than the whole limit are not kept (the tower runs each time);
a limit of 0 turns the cache off. The features are kept where they were computed (the model's device), as the
step's embeddings read them: the limit counts those bytes.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """content hash -> features [num_embeds, hidden_size], at most `max_bytes` of them, LRU."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        """The features of `key` (now the most recently used), or None."""
        features = self.entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return features

    def put(self, key: bytes, features: torch.Tensor) -> None:
        """Keep `features` under `key`, dropping the least recently used entries until they fit (none dropped, and
        nothing kept, when they alone exceed the limit)."""
        size = features.numel() * features.element_size()
        if size > self.max_bytes or key in self.entries:
            return
        while self.num_bytes + size > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.num_bytes -= dropped.numel() * dropped.element_size()
        self.entries[key] = features
        self.num_bytes += size

    def stats(self) -> dict:
        return {"encoder_cache_bytes": self.num_bytes, "encoder_cache_entries": len(self.entries),
                "encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses}
