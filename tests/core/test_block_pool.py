"""The block pool and KV-cache manager under random allocate / append / fork / free / evict / cache-hit runs.

The test keeps its own model of what every physical block holds (the token whose K/V sits in each slot), plays
the model runner (applies copy-on-write copies, then writes the step's tokens) and checks after every rule
that ref counts, the free queue, the block tables and the prefix-cache hash map agree with that model.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_hf import SamplingParams
from paged_hf.core.block_pool import Block, BlockPool, FreeBlockQueue
from paged_hf.core.kv_cache_manager import KVCacheManager, hash_block
from paged_hf.core.request import Request
from paged_hf.utils import cdiv

NUM_BLOCKS = 10
BLOCK_SIZE = 3
GARBAGE = -1  # what an evicted block holds once its new owner wrote into it
HOG = 9  # the token of the `hog` rule's requests
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)  # 3 symbols: shared prefixes are common


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True)
        self.kv = KVCacheManager(self.pool, BLOCK_SIZE)
        self.live: list[Request] = []
        self.history: list[list[int]] = []  # token sequences of every request so far (sources of hits)
        self.contents = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}  # block id -> token per slot
        self.prefix_of_hash: dict[bytes, tuple[int, ...]] = {}  # hash -> the tokens up to its block's end
        self.num_ids = 0

    # --- helpers ----------------------------------------------------------------------------------------
    def _new_request(self, tokens: list[int]) -> Request:
        self.num_ids += 1
        return Request(str(self.num_ids), 0, list(tokens), SamplingParams())

    def _snapshot(self, request: Request):
        pool = self.pool
        return (
            [(b.ref_count, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            {h: b.block_id for h, b in pool.cached_blocks.items()},
            {h: sorted(d) for h, d in pool.duplicate_blocks.items()},
            list(request.block_ids), request.num_computed_tokens, request.num_cached_blocks,
            list(self.kv._block_copies),
        )

    def _compute(self, request: Request, num_new: int, hits=()) -> bool:
        """Allocate slots and play the model runner: copies first, then the step's K/V writes."""
        before = self._snapshot(request)
        if not self.kv.allocate_slots(request, num_new, list(hits)):
            assert self._snapshot(request) == before, "a failed allocation changed the state"
            return False
        copies = self.kv.take_block_copies()
        assert len({dst for _, dst in copies}) == len(copies), "two copies into one block"
        sources = {src: list(self.contents[src]) for src, _ in copies}  # all reads before any write
        for src, dst in copies:
            self.contents[dst] = list(sources[src])
        start = request.num_computed_tokens
        for position in range(start, start + num_new):
            block = self.pool.blocks[request.block_ids[position // BLOCK_SIZE]]
            assert block.ref_count == 1, f"write into shared {block}: copy-on-write missed"
            self.contents[block.block_id][position % BLOCK_SIZE] = request.all_token_ids[position]
        request.num_computed_tokens += num_new
        self.kv.cache_full_blocks(request)
        self._record_hashes(request)
        return True

    def _record_hashes(self, request: Request) -> None:
        for i, block_hash in enumerate(request.block_hashes):
            prefix = tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE])
            assert self.prefix_of_hash.setdefault(block_hash, prefix) == prefix, "one hash, two prefixes"

    # --- rules ------------------------------------------------------------------------------------------
    @rule(tokens=TOKENS, data=st.data())
    def add(self, tokens, data):
        """A new request, often extending an earlier one's tokens (a prefix-cache hit)."""
        if self.history and data.draw(st.booleans()):
            source = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.one_of(st.just(len(source)), st.integers(0, len(source))))  # often all of it
            tokens = source[:cut] + tokens
        request = self._new_request(tokens)
        hits = self.kv.find_cached_prefix(request)
        for i, block in enumerate(hits):  # a hit holds exactly this request's tokens
            assert self.contents[block.block_id] == tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        num_left = len(tokens) - len(hits) * BLOCK_SIZE
        assert num_left >= 1, "the last token must never be a hit"
        if self._compute(request, data.draw(st.integers(1, num_left)), hits):
            self.live.append(request)
            self.history.append(list(tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.integers(1, 7), token=st.integers(0, 2))
    def append(self, data, num_new, token):
        """Compute more of a request (a prefill chunk), or decode one new token when it is caught up."""
        request = data.draw(st.sampled_from(self.live))
        if request.num_computed_tokens == request.num_tokens:
            request.all_token_ids.append(token)
        self._compute(request, min(num_new, request.num_tokens - request.num_computed_tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        """A child shares all of the parent's computed blocks (parallel sampling)."""
        parent = data.draw(st.sampled_from(self.live))
        child = self._new_request(parent.all_token_ids)
        self.kv.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        request = data.draw(st.sampled_from(self.live))
        self.kv.free(request)
        self.live.remove(request)
        assert request.block_ids == []

    @rule(num_blocks=st.integers(1, NUM_BLOCKS))
    def evict(self, num_blocks):
        """Someone else takes free blocks (evicting cached ones, LRU first), overwrites them, frees them."""
        blocks = self.pool.allocate(min(num_blocks, self.pool.num_free_blocks))
        for block in blocks:
            assert block.block_hash is None, "a reused block kept its old hash"
            self.contents[block.block_id] = [GARBAGE] * BLOCK_SIZE
        self.pool.free(blocks)

    @rule(num_left=st.integers(0, 3))
    def hog(self, num_left):
        """Another tenant takes all free blocks but `num_left` (the cached ones first, LRU order) and holds
        them for a while: allocations run close to an empty pool."""
        num_blocks = self.pool.num_free_blocks - num_left
        if num_blocks > 0:
            hog = self._new_request([HOG] * BLOCK_SIZE * num_blocks)
            assert self._compute(hog, hog.num_tokens)
            self.live.append(hog)

    @precondition(lambda self: self.live)
    @rule()
    def free_all(self):
        for request in self.live:
            self.kv.free(request)
        self.live = []
        assert self.pool.num_free_blocks == NUM_BLOCKS

    # --- invariants -------------------------------------------------------------------------------------
    @invariant()
    def ref_counts_equal_live_references(self):
        counts = [0] * NUM_BLOCKS
        for request in self.live:
            assert len(set(request.block_ids)) == len(request.block_ids), "a block twice in one table"
            assert len(request.block_ids) == cdiv(request.num_computed_tokens, BLOCK_SIZE)
            for block_id in request.block_ids:
                counts[block_id] += 1
        assert [b.ref_count for b in self.pool.blocks] == counts

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self):
        free = [b.block_id for b in self.pool.free_queue]
        assert len(free) == len(set(free)) == self.pool.num_free_blocks
        assert set(free) == {b.block_id for b in self.pool.blocks if b.ref_count == 0}

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for request in self.live:
            for position in range(request.num_computed_tokens):
                block_id = request.block_ids[position // BLOCK_SIZE]
                assert self.contents[block_id][position % BLOCK_SIZE] == request.all_token_ids[position]

    @invariant()
    def hash_map_points_only_at_matching_blocks(self):
        """Every hashed block is in the map (first or a duplicate) and holds its hash's tokens; a hash with
        duplicates always has a first block."""
        mapped = list(self.pool.cached_blocks.items())
        for block_hash, duplicates in self.pool.duplicate_blocks.items():
            assert duplicates and block_hash in self.pool.cached_blocks
            mapped += [(block_hash, block) for block in duplicates.values()]
        for block_hash, block in mapped:
            assert block.block_hash == block_hash
            prefix = self.prefix_of_hash[block_hash]
            assert self.contents[block.block_id] == list(prefix[-BLOCK_SIZE:]), f"{block} holds other tokens"
        hashed = [b for b in self.pool.blocks if b.block_hash is not None]
        assert sorted(b.block_id for b in hashed) == sorted(block.block_id for _, block in mapped)

    @invariant()
    def everything_is_free_when_idle(self):
        if not self.live:
            assert self.pool.num_free_blocks == NUM_BLOCKS
            assert all(b.ref_count == 0 for b in self.pool.blocks)


BlockPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase


# --- a few fixed cases ---------------------------------------------------------------------------------

def test_free_queue_is_lru_and_removes_from_the_middle():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])  # a cache hit taken out of the middle
    assert [b.block_id for b in queue] == [0, 1, 3, 4] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]


def test_freed_tail_blocks_are_evicted_first_and_lose_their_hash():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, 2)
    request = Request("a", 0, [5, 6, 7, 8, 9], SamplingParams())
    assert kv.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    kv.cache_full_blocks(request)
    head, middle, tail = request.block_ids
    kv.free(request)
    assert len(pool.cached_blocks) == 2 and pool.num_free_blocks == 4  # cached-but-unused blocks are free
    [first] = pool.allocate(1)
    assert first.block_id not in (head, middle, tail)  # the never-used block was older in the LRU order
    [second] = pool.allocate(1)
    assert second.block_id == tail
    [third] = pool.allocate(1)
    assert third.block_id == middle and third.block_hash is None and len(pool.cached_blocks) == 1


def test_a_live_duplicate_serves_hits_once_the_first_copy_is_evicted():
    """Two requests computed the same prefix at once: the second copy is kept under the hash too, so it
    serves hits after the first copy's request ended and its blocks were reused."""
    pool = BlockPool(6)
    kv = KVCacheManager(pool, 2)
    first, second = (Request(name, 0, [5, 6, 7, 8, 9], SamplingParams()) for name in "ab")
    for request in (first, second):
        assert kv.allocate_slots(request, 5)
        request.num_computed_tokens = 5
        kv.cache_full_blocks(request)
    kv.free(first)
    pool.allocate(3)  # every free block: the first copy is evicted
    later = Request("c", 0, [5, 6, 7, 8, 9], SamplingParams())
    assert [b.block_id for b in kv.find_cached_prefix(later)] == second.block_ids[:2]


def test_block_hash_is_stable_and_covers_parent_and_extra_keys():
    root = hash_block(None, [1, 2, 3])
    assert len(root) == 16
    assert hash_block(root, [4, 5, 6]) != hash_block(hash_block(None, [0, 2, 3]), [4, 5, 6])
    assert hash_block(None, [1, 2, 3], b"salt") != root
    # a fixed value: blake2b gives the same hash in every process (Python's hash() is salted per process)
    assert root.hex() == "32fb36bdb13306ba02fd8975f4461e93"
