"""The KV tier's bookkeeping: its byte-capped LRU, its keys (what they cover, what they do not), and the
transfers the KV-cache manager records for the runner (saves of dropped and computed blocks, loads of hits,
a load dropped when its block is reused before it was made)."""

from __future__ import annotations

import os
import sys

import torch

from paged_hf import SamplingParams
from paged_hf.core.block_pool import BlockPool
from paged_hf.core.kv_cache_manager import KVCacheManager, request_cache_key
from paged_hf.core.kv_tier import KVTier, LRUIndex, TierHit
from paged_hf.core.request import Request
from paged_hf.worker.kv_tier.offload import RequestKeys
from paged_hf.worker.kv_tier.store import MAX_QUEUED_BYTES, WRITE_THROUGH_QUEUED, DiskStore, HostStore, TieredStore

BLOCK = 4


def request(tokens, salt=None, request_id="r") -> Request:
    return Request(request_id, 0, list(tokens), SamplingParams(max_new_tokens=1), cache_salt=salt)


def tier(namespace=b"model-a", host_bytes=1 << 20) -> KVTier:
    store = TieredStore(HostStore(host_bytes), None, host_is_tier=True)
    return KVTier(namespace, store, RequestKeys(), BLOCK)


def payload(value: float) -> dict:
    return {"k.0": torch.full((BLOCK, 1, 2), value), "v.0": torch.full((BLOCK, 1, 2), -value)}


def test_lru_index_evicts_least_recent_within_its_bytes():
    index = LRUIndex(100)
    assert index.add(b"a", 40) == [] and index.add(b"b", 40) == []
    index.touch(b"a")
    assert index.add(b"c", 40) == [b"b"]  # b is the least recently used
    assert b"a" in index and b"c" in index and index.bytes_held == 80
    assert index.add(b"huge", 101) == [b"huge"] and b"huge" not in index
    assert index.add(b"a", 10) == [] and index.bytes_held == 50  # re-adding replaces the size
    assert index.discard(b"a") and not index.discard(b"a") and index.bytes_held == 40


def test_keys_cover_the_whole_prefix_the_namespace_and_the_salt():
    tokens = list(range(3, 3 + 3 * BLOCK + 1))
    keys = tier().block_keys(request(tokens))
    assert len(keys) == 3 and len(set(keys)) == 3
    assert tier().block_keys(request(tokens)) == keys  # stable: another tier, another request object
    changed = [99] + tokens[1:]  # one token of the first block: every later key changes (the chain)
    assert not set(tier().block_keys(request(changed))) & set(keys)
    assert not set(tier(namespace=b"model-b").block_keys(request(tokens))) & set(keys)
    assert not set(tier().block_keys(request(tokens, salt="tenant"))) & set(keys)
    grown = request(tokens)
    t = tier()
    t.block_keys(grown)
    grown.append_token(7)
    grown.append_token(8)
    grown.append_token(9)
    assert t.block_keys(grown)[:3] == keys and len(t.block_keys(grown)) == 4


def test_dropped_blocks_are_saved_and_found_again():
    pool = BlockPool(4)
    kv_tier = tier()
    manager = KVCacheManager(pool, BLOCK, kv_tier)
    first = request(range(10, 10 + 2 * BLOCK + 1))
    assert manager.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    manager.cache_full_blocks(first, request_cache_key(first))
    assert kv_tier.take_transfers().saves == {}  # no disk: nothing is written through
    manager.free(first)
    other = request(range(60, 60 + 4 * BLOCK - 1), request_id="other")
    assert manager.allocate_slots(other, other.num_tokens)  # takes every block: the cached two are dropped
    transfers = kv_tier.take_transfers()
    keys = kv_tier.block_keys(first)
    assert sorted(key for key, _ in transfers.saves.values()) == sorted(keys)
    assert all(evicted for _, evicted in transfers.saves.values())
    for (key, evicted), value in zip(transfers.saves.values(), (1.0, 2.0)):
        kv_tier.store.put(key, payload(value), evicted)  # what the runner does with the blocks' contents
    manager.free(other)
    again = request(range(10, 10 + 2 * BLOCK + 1), request_id="again")
    hits = manager.find_cached_prefix(again, request_cache_key(again))
    assert [type(h) for h in hits] == [TierHit, TierHit] and [h.key for h in hits] == keys
    assert manager.allocate_slots(again, 1, hits)
    assert again.num_computed_tokens == 2 * BLOCK and len(again.block_ids) == 3
    loads = kv_tier.take_transfers().loads
    assert sorted(loads) == sorted(again.block_ids[:2])
    assert kv_tier.stats()["kv_tier_hits"] == 2 * BLOCK
    # the loaded blocks are published: a request with the same prefix hits them in the pool
    same = request(range(10, 10 + 2 * BLOCK + 1), request_id="same")
    assert [h.block_id for h in manager.find_cached_prefix(same, request_cache_key(same))] == again.block_ids[:2]


def test_a_load_into_a_block_reused_before_the_step_is_dropped():
    pool = BlockPool(3)
    kv_tier = tier()
    manager = KVCacheManager(pool, BLOCK, kv_tier)
    prefix = request(range(20, 20 + BLOCK + 1))
    key = kv_tier.block_keys(prefix)[0]
    kv_tier.store.put(key, payload(3.0), evicted=True)
    hits = manager.find_cached_prefix(prefix, request_cache_key(prefix))
    assert manager.allocate_slots(prefix, 1, hits)
    loaded = prefix.block_ids[0]
    manager.free(prefix)  # aborted before any step ran: its loaded block sits in the free queue
    greedy = request(range(40, 40 + 3 * BLOCK), request_id="greedy")
    assert manager.allocate_slots(greedy, greedy.num_tokens)  # reuses every block, the loaded one too
    transfers = kv_tier.take_transfers()
    assert loaded not in transfers.loads and loaded not in transfers.saves  # never saved as `key`'s content


def test_blocks_the_pool_drops_may_fill_the_writers_queue_and_just_computed_ones_only_part_of_it(tmp_path):
    """A block the pool drops is its only copy: it may queue up to MAX_QUEUED_BYTES; a block just computed (still
    in the pool, saved again when dropped) only while fewer than WRITE_THROUGH_QUEUED wait."""
    expected = {"k.0": (torch.float32, (BLOCK, 1, 2)), "v.0": (torch.float32, (BLOCK, 1, 2))}
    disk = DiskStore(tmp_path, 1 << 30, b"model-a", expected)
    assert disk.max_queued_writes == MAX_QUEUED_BYTES // (2 * BLOCK * 2 * 4) > WRITE_THROUGH_QUEUED
    store = TieredStore(HostStore(0), disk, host_is_tier=False)
    with disk.lock:  # the writer takes nothing meanwhile: WRITE_THROUGH_QUEUED - 1 blocks already wait
        disk.queued.update(i.to_bytes(16, "little") for i in range(WRITE_THROUGH_QUEUED - 1))
        saves = [(1, b"x" * 16, False), (2, b"y" * 16, False), (3, b"z" * 16, True)]
        assert store.admit(saves) == [saves[0], saves[2]] and disk.num_writes_dropped == 1
        disk.queued.clear()
    disk.close()


def test_a_steps_chunk_is_written_once_per_key_and_what_the_writer_cannot_take_is_dropped(tmp_path):
    """put_many: a key twice in one step (two requests computed the same block) is one file; blocks past the
    writer's room are dropped and counted, never waited for; the writer thread runs at the lowest priority."""
    expected = {"k.0": (torch.float32, (BLOCK, 1, 2)), "v.0": (torch.float32, (BLOCK, 1, 2))}
    disk = DiskStore(tmp_path, 1 << 20, b"model-a", expected, max_queued_writes=2)
    if sys.platform.startswith("linux"):
        assert os.getpriority(os.PRIO_PROCESS, disk.writer.native_id) == 19
    gathered = {name: torch.stack([payload(v)[name] for v in (1.0, 2.0, 3.0, 4.0)]) for name in expected}
    disk.put_many([b"a" * 16, b"a" * 16, b"b" * 16, b"c" * 16], gathered)
    assert disk.flush(30) and disk.num_writes_dropped == 1
    assert sorted(p.name[:4] for p in tmp_path.iterdir()) == ["6161", "6262"]
    assert disk.num_bytes_written == disk.bytes_held == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert torch.equal(disk.read(b"b" * 16)["v.0"], payload(3.0)["v.0"]) and disk.read(b"c" * 16) is None
    disk.close()
