"""Gives each request the blocks its tokens need, finds prefix-cache hits, and hashes full blocks."""

from __future__ import annotations

import hashlib
from array import array

from .block_pool import Block, BlockPool
from .request import Request


def hash_block(parent_hash: bytes | None, token_ids: list[int], extra_keys: bytes = b"") -> bytes:
    """A stable hash of a full block: its parent's hash, its tokens and whatever else changes its K/V."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_keys)
    return digest.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int):
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = block_pool.enable_caching
        self._num_cached_blocks: dict[int, int] = {}  # id(request) -> how many of its blocks are hashed

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- prefix cache ---------------------------------------------------------------------------------
    def request_block_hashes(self, request: Request, extra_keys: bytes = b"") -> list[bytes]:
        """Hashes of the request's full blocks, extended incrementally as its tokens grow."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start : start + size], extra_keys))
        return hashes

    def find_cached_prefix(self, request: Request, extra_keys: bytes = b"") -> list[Block]:
        """The longest run of cached blocks at the start of the request. The last token is never a hit, so a
        full hit still computes one token and yields logits."""
        if not self.enable_caching:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.request_block_hashes(request, extra_keys)[:max_hit_blocks]:
            block = self.block_pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request: Request, extra_keys: bytes = b"") -> None:
        """Publish the request's blocks that are now full and computed."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(id(request), 0)
        if num_full <= start:
            return
        hashes = self.request_block_hashes(request, extra_keys)
        blocks = self.block_pool.blocks
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[request.block_ids[i]], hashes[i])
        self._num_cached_blocks[id(request)] = num_full

    # --- slots ----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[Block] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after `cached_blocks` (prefix hits,
        which become its first blocks). All or nothing: False and no change when the pool is short."""
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_have = len(request.block_ids) + len(cached_blocks)
        num_new_blocks = self.num_blocks_needed(num_computed + num_new_tokens) - num_have
        # hits that sit in the free queue stop being free once taken
        num_free_hits = sum(1 for block in cached_blocks if block.ref_count == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            return False
        if cached_blocks:
            self.block_pool.touch(list(cached_blocks))
            request.block_ids.extend(block.block_id for block in cached_blocks)
            request.num_computed_tokens = num_computed
            self._num_cached_blocks[id(request)] = len(request.block_ids)
        if num_new_blocks > 0:
            request.block_ids.extend(block.block_id for block in self.block_pool.allocate(num_new_blocks))
        return True

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first (so its tail is evicted before its shareable head)."""
        blocks = self.block_pool.blocks
        self.block_pool.free([blocks[i] for i in reversed(request.block_ids)])
        request.block_ids = []
        self._num_cached_blocks.pop(id(request), None)
