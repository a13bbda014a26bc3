"""Physical KV blocks: ref counts, an O(1) LRU free queue and the prefix-cache hash map.

Freed blocks keep their hash (lazy eviction): a later request with the same prefix can take them back out of
the free queue until they are reused for other tokens. The free queue is a doubly linked list threaded
through the blocks themselves, so removing a cache hit from the middle is O(1) and the order is the LRU
eviction order (vLLM V1's design). `on_evict` (the KV tier's hook) hears of every cached block about to be reused,
before anything overwrites it, so its K/V can still be saved.
"""

from __future__ import annotations


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_count={self.ref_count}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; the head is evicted first."""

    def __init__(self, blocks: list[Block]):
        self._head = Block(-1)  # sentinels: no None checks on the hot path
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: Block) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not in the free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> Block:
        block = self._head.next_free
        assert block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every block. A block is either referenced (ref_count > 0) or in the free queue, never both."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, Block] = {}  # block hash -> the block holding those tokens' K/V
        # more blocks with a hash already mapped (requests that computed the same prefix at once): each
        # takes over the hash when the mapped block is evicted, so a live copy keeps serving hits
        self.duplicate_blocks: dict[bytes, dict[int, Block]] = {}
        # called as on_evict(block, block_hash, last_copy) when a cached block is taken for other tokens
        # (last_copy: no duplicate keeps serving its hash); None: nobody listens
        self.on_evict = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` fresh blocks (evicting cached ones in LRU order). All or nothing."""
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks, only {len(self.free_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found in the prefix cache (and on shared blocks of a fork)."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference of each block; pass a request's blocks tail first, so tails are evicted first."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        """Publish a full, computed block under its hash. Lookups return the first block with a hash; a
        later one with the same hash waits among the duplicates for the first to be evicted."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash in self.cached_blocks:
            self.duplicate_blocks.setdefault(block_hash, {})[block.block_id] = block
        else:
            self.cached_blocks[block_hash] = block

    def _evict(self, block: Block) -> None:
        """The block is about to hold other tokens: it leaves the hash map (a duplicate takes its place)."""
        block_hash, block.block_hash = block.block_hash, None
        if block_hash is None:
            return
        duplicates = self.duplicate_blocks.get(block_hash)
        last_copy = False
        if self.cached_blocks.get(block_hash) is block:
            if duplicates:
                _, self.cached_blocks[block_hash] = duplicates.popitem()
            else:
                del self.cached_blocks[block_hash]
                last_copy = True
        elif duplicates is not None:
            del duplicates[block.block_id]
        if duplicates is not None and not duplicates:
            del self.duplicate_blocks[block_hash]
        if self.on_evict is not None:
            self.on_evict(block, block_hash, last_copy)
