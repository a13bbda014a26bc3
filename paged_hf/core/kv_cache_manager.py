"""Gives each request the blocks its tokens need, finds prefix-cache hits, hashes full blocks, forks children.

Blocks shared between requests (prefix hits, forked children of one `n > 1` request) are never written in
place: a request that must write into a block with `ref_count > 1` first gets a private copy of it
(copy-on-write). The copy itself is done by the model runner before the step's forward; this manager only
records the `(src, dst)` pairs (`take_block_copies`).

With a KV tier (`core/kv_tier.py`), a prefix lookup goes on past the pool's hits into the tier: its hits
(`TierHit`) get fresh blocks, published under their hash at once, and the tier records the loads the runner makes
before the forward. Newly computed full blocks and the blocks the pool drops are handed to the tier to save.
"""

from __future__ import annotations

import hashlib
from array import array

from paged_hf.core.block_pool import Block, BlockPool
from paged_hf.core.kv_tier import KVTier, TierHit
from paged_hf.core.multimodal import block_mm_keys
from paged_hf.core.request import Request
from paged_hf.core.state_slots import StateSlots
from paged_hf.utils import cdiv


def hash_block(parent_hash: bytes | None, token_ids: list[int], extra_keys: bytes = b"") -> bytes:
    """A stable hash of a full block: its parent's hash, its tokens and whatever else changes its K/V.

    blake2b, never Python's `hash()` (salted per process, and 64 bits only). The chain on the parent hash
    makes a block's hash stand for its whole prefix, so equal hashes mean equal K/V (positions included).
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())  # fixed width: the boundary to extra_keys is unambiguous
    digest.update(extra_keys)
    return digest.digest()


def request_cache_key(request: Request) -> bytes:
    """The extra keys of a request's blocks: adapter name and version (a re-loaded adapter, same name with new
    weights, must never hit blocks computed with the old weights) and cache salt, each length-prefixed so
    that no two different combinations give the same bytes."""
    parts = []
    if request.adapter is not None:
        parts.append(b"adapter:" + request.adapter.encode())
    if request.adapter_version is not None:
        parts.append(b"adapter_version:" + str(request.adapter_version).encode())
    if request.cache_salt is not None:
        parts.append(b"salt:" + request.cache_salt.encode())
    return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, tier: KVTier | None = None,
                 state_slots: StateSlots | None = None):
        """`state_slots`: a hybrid model's recurrent-state slots, taken and given back with a request's blocks."""
        self.block_pool = block_pool
        self.state_slots = state_slots
        self.block_size = block_size
        self.enable_caching = block_pool.enable_caching
        self._block_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write pairs of this step
        self.num_block_copies = 0  # copy-on-write copies made so far (a counter for tests and stats)
        # called with each request whose blocks go back (finished, aborted, preempted): state kept beside a
        # request's blocks (a draft model's own cache) goes with them
        self.free_listeners: list = []
        self.tier = tier if block_pool.enable_caching else None
        self.tier_keys: dict[bytes, bytes] = {}  # pool block hash -> tier key, while the pool holds that hash
        if self.tier is not None:
            block_pool.on_evict = self._on_evict

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- prefix cache ---------------------------------------------------------------------------------
    def request_block_hashes(self, request: Request, extra_keys: bytes = b"") -> list[bytes]:
        """Hashes of the request's full blocks, extended incrementally as its tokens grow. Recomputed when
        the extra keys changed (an adapter reloaded while the request was preempted): stale hashes would
        hit blocks computed with the old weights."""
        if request.block_hashes_key != extra_keys:
            request.block_hashes = []
            request.block_hashes_key = extra_keys
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        items = request.mm_items  # a block holding an image's placeholders also hashes the image's content
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            keys = extra_keys + block_mm_keys(items, start, start + size) if items else extra_keys
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start : start + size], keys))
        return hashes

    def find_cached_prefix(self, request: Request, extra_keys: bytes = b"") -> list[Block | TierHit]:
        """The longest run of cached blocks at the start of a request that holds no blocks yet: pool blocks,
        then (with a tier) blocks of the pool or the tier. The last token is never a hit, so a full hit still
        computes one token and yields logits."""
        assert not request.block_ids and request.num_computed_tokens == 0, "prefix lookup of a started request"
        if not self.enable_caching:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.request_block_hashes(request, extra_keys)[:max_hit_blocks]
        hits: list[Block | TierHit] = []
        for block_hash in hashes:
            block = self.block_pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.tier is not None and len(hits) < len(hashes):
            keys = self.tier.block_keys(request)
            num_reads = self.block_pool.num_free_blocks  # each tier hit takes a free block: read no more than fit
            for block_hash, key in zip(hashes[len(hits) :], keys[len(hits) :]):
                hit = self.block_pool.lookup(block_hash)
                if hit is None and num_reads > 0:
                    hit = self.tier.lookup(key)
                    num_reads -= 1
                if hit is None:
                    break
                hits.append(hit)
        return hits

    def cache_full_blocks(self, request: Request, extra_keys: bytes = b"") -> None:
        """Publish the request's blocks that are now full and computed (their K/V is written)."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        hashes = self.request_block_hashes(request, extra_keys)
        keys = self.tier.block_keys(request) if self.tier is not None else None
        blocks = self.block_pool.blocks
        for i in range(request.num_cached_blocks, num_full):
            block = blocks[request.block_ids[i]]
            published = block.block_hash is None
            self.block_pool.cache_block(block, hashes[i])
            if keys is not None and published:
                self.tier_keys.setdefault(hashes[i], keys[i])
                self.tier.on_computed(block.block_id, keys[i])
        request.num_cached_blocks = num_full

    # --- slots ----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[Block | TierHit] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after `cached_blocks` (prefix hits,
        which become its first blocks; a tier hit takes a fresh block), copying shared blocks it is about to
        write into (copy-on-write). All or nothing: False and no change at all when the pool is short."""
        assert not cached_blocks or not request.block_ids, "prefix hits for a request that holds blocks"
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_have = len(request.block_ids) + len(cached_blocks)
        num_new_blocks = max(0, self.num_blocks_needed(num_computed + num_new_tokens) - num_have)
        to_copy = self._shared_blocks_to_write(request, num_new_tokens)
        # hits that sit in the free queue stop being free once taken; tier hits take a block each
        num_tier_hits = sum(1 for block in cached_blocks if isinstance(block, TierHit))
        num_free_hits = sum(1 for block in cached_blocks if isinstance(block, Block) and block.ref_count == 0)
        if num_new_blocks + len(to_copy) + num_tier_hits > self.block_pool.num_free_blocks - num_free_hits:
            return False
        states = self.state_slots
        if states is not None and states.needs_slot(request):
            if states.num_free == 0:
                return False
            states.take(request)
        if self.tier is not None and request.num_computed_tokens == 0 and not request.block_ids:
            num_pool_hits = next((i for i, b in enumerate(cached_blocks) if isinstance(b, TierHit)), len(cached_blocks))
            self.tier.count_lookup(request.num_tokens - num_pool_hits * self.block_size,
                                   num_tier_hits * self.block_size)
        if cached_blocks:
            request.block_ids.extend(self._take_hits(request, cached_blocks))
            request.num_computed_tokens = num_computed
            request.num_cached_blocks = len(request.block_ids)
        fresh = self.block_pool.allocate(len(to_copy) + num_new_blocks)
        for index, block in zip(to_copy, fresh):
            self._copy_on_write(request, index, block)
        request.block_ids.extend(block.block_id for block in fresh[len(to_copy) :])
        return True

    def _take_hits(self, request: Request, cached_blocks: list[Block | TierHit]) -> list[int]:
        """Reference the pool hits, then give each tier hit a fresh block, published under its hash at once (a
        request admitted next shares it) and loaded by the runner before the forward -> the block ids."""
        pool_hits = [block for block in cached_blocks if isinstance(block, Block)]
        self.block_pool.touch(pool_hits)  # first: allocating the fresh blocks must not evict them
        fresh = iter(self.block_pool.allocate(len(cached_blocks) - len(pool_hits)))
        block_ids = []
        for i, hit in enumerate(cached_blocks):
            if isinstance(hit, Block):
                block_ids.append(hit.block_id)
                continue
            block = next(fresh)
            block_hash = request.block_hashes[i]
            self.block_pool.cache_block(block, block_hash)
            self.tier_keys.setdefault(block_hash, hit.key)
            self.tier.on_load(block.block_id, hit)
            block_ids.append(block.block_id)
        return block_ids

    def _on_evict(self, block: Block, block_hash: bytes, last_copy: bool) -> None:
        key = self.tier_keys.pop(block_hash, None) if last_copy else self.tier_keys.get(block_hash)
        self.tier.on_evict(block.block_id, key, last_copy)

    def _shared_blocks_to_write(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indices (in the block table) of shared blocks that the next `num_new_tokens` tokens write into.
        Only the block holding position `num_computed_tokens` can be both shared and partly written: blocks
        before it are full and never written again, blocks after it are this request's own."""
        if num_new_tokens <= 0:
            return []
        first = request.num_computed_tokens // self.block_size
        last = min(len(request.block_ids), self.num_blocks_needed(request.num_computed_tokens + num_new_tokens))
        blocks = self.block_pool.blocks
        return [i for i in range(first, last) if blocks[request.block_ids[i]].ref_count > 1]

    def _copy_on_write(self, request: Request, index: int, fresh: Block) -> None:
        """Swap the shared block at `index` of the table for `fresh`, which the runner fills with a copy of
        it before the forward. The other holders keep the original, untouched."""
        shared = self.block_pool.blocks[request.block_ids[index]]
        assert shared.ref_count > 1, f"copy-on-write of an unshared {shared}"
        self._block_copies.append((shared.block_id, fresh.block_id))
        self.num_block_copies += 1
        request.block_ids[index] = fresh.block_id
        self.block_pool.free([shared])  # one reference less; the siblings still hold it
        # a partial block is never hashed, so the copy's place in the cache is unchanged
        request.num_cached_blocks = min(request.num_cached_blocks, index)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies the runner must make before this step's forward; resets the list."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) recurrent-state slot copies (forks of a hybrid model's requests) of this step."""
        return self.state_slots.take_copies() if self.state_slots is not None else []

    # --- fork and free --------------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share the parent's computed blocks (one more reference each) and skip the tokens the
        parent already computed. Its first write into the shared partial block copies it."""
        assert not child.block_ids and child.num_computed_tokens == 0, "fork into a started request"
        num_computed = parent.num_computed_tokens
        assert child.all_token_ids[:num_computed] == parent.all_token_ids[:num_computed], "fork of other tokens"
        blocks = [self.block_pool.blocks[i] for i in parent.block_ids[: self.num_blocks_needed(num_computed)]]
        self.block_pool.touch(blocks)
        child.block_ids = [block.block_id for block in blocks]
        child.num_computed_tokens = num_computed
        num_full = num_computed // self.block_size
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.block_hashes_key = parent.block_hashes_key
        child.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        if self.state_slots is not None:
            self.state_slots.fork(parent, child)

    def trim(self, request: Request) -> None:
        """Free the blocks past the request's tokens (those of rejected drafts), tail first. They are its
        own (shared blocks only hold computed tokens) and were never hashed (their tokens were unverified)."""
        num_keep = self.num_blocks_needed(request.num_tokens)
        tail = request.block_ids[num_keep:]
        if tail:
            blocks = self.block_pool.blocks
            self.block_pool.free([blocks[i] for i in reversed(tail)])
            del request.block_ids[num_keep:]

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first (so its tail is evicted before its shareable head). A copy
        into one of its blocks that the runner has not made yet is dropped: nobody will read it."""
        if self._block_copies:
            own = set(request.block_ids)
            self._block_copies = [(src, dst) for src, dst in self._block_copies if dst not in own]
        blocks = self.block_pool.blocks
        self.block_pool.free([blocks[i] for i in reversed(request.block_ids)])
        request.block_ids = []
        request.num_cached_blocks = 0
        if self.state_slots is not None:
            self.state_slots.release(request)
        for listener in self.free_listeners:
            listener(request)
