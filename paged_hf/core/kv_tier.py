"""The second KV tier's bookkeeping: stable keys, byte-capped LRU indexes and the transfers the runner makes.

Below the block pool sit host memory and a directory on disk (the store, `worker/kv_tier/store.py`). A full block
the pool drops goes to host memory; a newly computed full block goes to disk (write-through, so a restart finds
what was cached in the pool too). A prefix lookup that runs past the pool's hits asks the store; a hit is read
(and checked) at lookup, held here as an opaque payload, and loaded into a fresh pool block by the runner before
the step's forward, so the request skips those tokens exactly as it skips pool hits.

The tier's keys are not the pool's block hashes: those hold the adapter's per-process version. A tier key is a
chain over the whole token prefix rooted in the namespace (model weights, config and dtype, KV cache dtype,
block size: `worker/kv_tier/offload.py`) and the request's stable key (the adapter's content hash, the cache salt),
so equal keys mean equal K/V in any process that loads the same model.

No torch here (core is bookkeeping): payloads are whatever the store hands back, moved by the worker.
"""

from __future__ import annotations

import hashlib
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from paged_hf.core.multimodal import block_mm_keys
from paged_hf.core.request import Request


def tier_block_key(parent: bytes, token_ids: list[int], mm_keys: bytes = b"") -> bytes:
    """A block's key: its parent's key (the namespace and request key at the root), its tokens and the content
    hashes of the images whose placeholders it holds (`core/multimodal.py`)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    digest.update(mm_keys)
    return digest.digest()


def tier_root_key(namespace: bytes, request_key: bytes) -> bytes:
    digest = hashlib.blake2b(b"paged_hf-kv-tier/1", digest_size=16)
    for part in (namespace, request_key):
        digest.update(len(part).to_bytes(4, "little") + part)
    return digest.digest()


class LRUIndex:
    """key -> bytes held, least recently used first, within `capacity` bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.bytes_held = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, key: bytes) -> None:
        self.entries.move_to_end(key)

    def add(self, key: bytes, nbytes: int) -> list[bytes]:
        """Hold `key` (most recent) -> the keys evicted to stay within the cap, least recent first. An entry
        larger than the whole cap is not held: it comes back as evicted itself."""
        self.discard(key)
        if nbytes > self.capacity:
            return [key]
        self.entries[key] = nbytes
        self.bytes_held += nbytes
        evicted = []
        while self.bytes_held > self.capacity:
            old, old_bytes = self.entries.popitem(last=False)
            self.bytes_held -= old_bytes
            evicted.append(old)
        return evicted

    def discard(self, key: bytes) -> bool:
        nbytes = self.entries.pop(key, None)
        if nbytes is None:
            return False
        self.bytes_held -= nbytes
        return True


class TierStore(Protocol):
    """What the worker's store does (paged_hf.worker.kv_tier.store.TieredStore)."""

    def wants(self, key: bytes, evicted: bool) -> bool:
        """Whether a block under `key` should be saved: dropped by the pool (`evicted`) or just computed."""

    def fetch(self, key: bytes) -> object | None:
        """The block's payload, read and checked; None when missing or unreadable (never a bad payload)."""

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the saves handed over so far landed -> whether they did in time."""

    def stats(self) -> dict: ...


@dataclass
class TierHit:
    """A prefix block found in the tier: the runner loads `payload` into a fresh pool block before the forward."""

    key: bytes
    payload: object


@dataclass
class TierTransfers:
    """What the runner does before the next forward: first the saves (read blocks the pool dropped or just
    computed), then the step's copy-on-write copies, then the loads (write tier hits into fresh blocks)."""

    saves: dict[int, tuple[bytes, bool]] = field(default_factory=dict)  # block id -> (key, evicted)
    loads: dict[int, TierHit] = field(default_factory=dict)  # block id -> its hit


class KVTier:
    """Keys, lookups and the pending transfers, between the KV-cache manager (which records them) and the
    model runner (which takes them before each forward: `take_transfers`)."""

    def __init__(self, namespace: bytes, store: TierStore, request_key: Callable[[Request], bytes], block_size: int):
        self.namespace = namespace
        self.store = store
        self.request_key = request_key  # the adapter's content hash and the cache salt, as bytes
        self.block_size = block_size
        self.pending = TierTransfers()
        self._keys: weakref.WeakKeyDictionary[Request, tuple[bytes, list[bytes]]] = weakref.WeakKeyDictionary()
        self.num_queried_tokens = 0  # tokens looked up in the tier (past the pool's hits)
        self.num_hit_tokens = 0

    def block_keys(self, request: Request) -> list[bytes]:
        """Keys of the request's full blocks, extended as its tokens grow (recomputed if its key changed)."""
        request_key = self.request_key(request)
        cached = self._keys.get(request)
        if cached is None or cached[0] != request_key:
            cached = (request_key, [])
            self._keys[request] = cached
        keys = cached[1]
        tokens, size = request.all_token_ids, self.block_size
        root = tier_root_key(self.namespace, request_key) if not keys else None
        while (len(keys) + 1) * size <= len(tokens):
            start = len(keys) * size
            mm_keys = block_mm_keys(request.mm_items, start, start + size) if request.mm_items else b""
            keys.append(tier_block_key(keys[-1] if keys else root, tokens[start : start + size], mm_keys))
        return keys

    def prompt_params(self, request: Request) -> dict:
        """What a KV consumer needs to find `request`'s full prompt blocks (disaggregated prefill/decode): the
        namespace (another model's blocks are never looked up) and the blocks' keys, in prompt order."""
        num_full = request.num_prompt_tokens // self.block_size
        return {"namespace": self.namespace.hex(), "block_keys": [k.hex() for k in self.block_keys(request)[:num_full]]}

    def lookup(self, key: bytes) -> TierHit | None:
        payload = self.store.fetch(key)
        return None if payload is None else TierHit(key, payload)

    def count_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    # --- transfers ------------------------------------------------------------------------------------
    def on_computed(self, block_id: int, key: bytes) -> None:
        """A full block's K/V was just computed under `key` (write-through to disk when the store wants it)."""
        if self.store.wants(key, evicted=False):
            self._save(block_id, key, evicted=False)

    def on_load(self, block_id: int, hit: TierHit) -> None:
        self.pending.loads[block_id] = hit

    def on_evict(self, block_id: int, key: bytes | None, last_copy: bool) -> None:
        """The pool reuses the block for other tokens. A load into it not made yet is dropped (nobody reads it,
        and its content is not that key's); the last copy of a key is saved to the store."""
        if self.pending.loads.pop(block_id, None) is not None:
            return
        if key is not None and last_copy and self.store.wants(key, evicted=True):
            self._save(block_id, key, evicted=True)

    def _save(self, block_id: int, key: bytes, evicted: bool) -> None:
        previous = self.pending.saves.get(block_id)
        if previous is not None and previous[0] != key:
            return  # the block's earlier content is still to be read: it goes first, the runner reads it once
        self.pending.saves[block_id] = (key, evicted or (previous is not None and previous[1]))

    def take_saves(self) -> dict[int, tuple[bytes, bool]]:
        """The pending saves alone (the loads wait for their step's copies)."""
        saves, self.pending.saves = self.pending.saves, {}
        return saves

    def take_transfers(self) -> TierTransfers:
        transfers, self.pending = self.pending, TierTransfers()
        return transfers

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the store landed the saves the runner handed it (its writer runs in the background)."""
        return self.store.flush(timeout)

    def stats(self) -> dict:
        return {"kv_tier_queries": self.num_queried_tokens, "kv_tier_hits": self.num_hit_tokens,
                **self.store.stats()}
