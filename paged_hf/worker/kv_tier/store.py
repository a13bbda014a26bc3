"""Where the KV tier keeps blocks: host memory and a directory of safetensors files, each LRU within its bytes.

A payload is one block's K/V for every layer (and a quantized cache's scales), as CPU tensors by name. On disk
one block is one file, `<key hex>.safetensors`: the cache's tensors back to back after a header (`BlockLayout`).
A step's blocks reach the writer thread as one chunk (name -> [num_blocks, ...], the runner's one gather per
layer); the thread runs at the lowest OS priority and writes each block to a temporary name and renames it, so a
crash never leaves a torn block under a real name. Its queue is bounded: blocks past it are dropped, a step
never waits for the disk. The metadata holds the format, the namespace, the key and a checksum of the bytes; a
file that fails any check (truncated, overwritten, another model's, renamed) is deleted and counts as a miss,
never loaded as K/V. The files' modification times are the LRU order, so it survives a restart.

Why not LMCache: it installs on CPU (0.5.6) but its paged-memory connector needs `torch.cuda.Stream` and its
`cuda_ops` need libc10_cuda; only its no-op mock connector runs without CUDA (docs/prefix_caching.md).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import torch
from transformers.utils import logging

from paged_hf.core.kv_tier import LRUIndex
from paged_hf.worker.kv_tier.block_file import FORMAT, BlockLayout, checksum, decode, payload_nbytes

logger = logging.get_logger(__name__)

SUFFIX = ".safetensors"
STALE_TEMP_SECONDS = 600  # temporary files older than this are leftovers of a crash
#: the writer's queue (it runs at the lowest OS priority and falls behind while steps run): at most these bytes
#: of blocks wait in memory, and blocks just computed (still in the pool) only while fewer than
#: WRITE_THROUGH_QUEUED wait; a block the pool drops is its only copy and may use it all. Past it, dropped.
MAX_QUEUED_BYTES = 768 << 20
WRITE_THROUGH_QUEUED = 256


class HostStore:
    """Payloads in CPU memory, LRU within `capacity` bytes."""

    def __init__(self, capacity: int):
        self.index = LRUIndex(capacity)
        self.payloads: dict[bytes, dict[str, torch.Tensor]] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self.payloads

    def get(self, key: bytes) -> dict | None:
        payload = self.payloads.get(key)
        if payload is not None:
            self.index.touch(key)
        return payload

    def put(self, key: bytes, payload: dict[str, torch.Tensor]) -> None:
        for old in self.index.add(key, payload_nbytes(payload)):
            self.payloads.pop(old, None)
        if key in self.index:  # a view of a step's gather is copied: held alone, it would pin the whole gather
            self.payloads[key] = {name: t.clone() if t.untyped_storage().nbytes() > t.nbytes else t
                                  for name, t in payload.items()}


class DiskStore:
    """One safetensors file per block in `folder`, at most `capacity` bytes of them (LRU by modification time).
    The engine thread reads; one writer thread writes and deletes. The index is shared under a lock."""

    def __init__(self, folder: str | os.PathLike, capacity: int, namespace: bytes,
                 expected: dict[str, tuple[torch.dtype, tuple]], max_queued_writes: int | None = None,
                 write_through_queued: int = WRITE_THROUGH_QUEUED):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.layout = BlockLayout(expected)
        self.index = LRUIndex(capacity)
        self.lock = threading.Lock()
        self.queued: set[bytes] = set()  # keys waiting for the writer
        # their contents meanwhile (key -> (the step's gathered blocks, row)): a lookup before the write lands hits
        self.pending: dict[bytes, tuple[dict[str, torch.Tensor], int]] = {}
        self.num_bytes_written = 0
        self.num_writes_dropped = 0
        self.num_bad_files = 0
        self._scan()
        self.max_queued_writes = max_queued_writes or max(16, MAX_QUEUED_BYTES // max(1, self.layout.nbytes))
        self.write_through_queued = write_through_queued  # a KV producer's: every computed block (kv_transfer)
        self.writes: queue.Queue = queue.Queue()  # chunks of blocks (one per step); bounded by max_queued_writes
        # the thread holds the store weakly: once the engine is gone it ends (a None in the queue wakes it)
        self.writer = threading.Thread(target=_write_loop, args=(self.writes, weakref.ref(self)),
                                       name="paged_hf-kv-writer", daemon=True)
        self.writer.start()
        weakref.finalize(self, self.writes.put, None)
        close = weakref.WeakMethod(self.close)
        atexit.register(lambda: close() is not None and close()())  # a clean exit lands the queued writes

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """Index the folder's block files, oldest first (their LRU order from before a restart); delete stale
        temporary files and whatever is over the cap."""
        now = time.time()
        found = []
        for entry in os.scandir(self.folder):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue  # deleted meanwhile (another engine on the same folder)
            if entry.name.endswith(".tmp") and now - stat.st_mtime > STALE_TEMP_SECONDS:
                _unlink(Path(entry.path))
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                try:
                    found.append((stat.st_mtime, bytes.fromhex(entry.name[: -len(SUFFIX)]), stat.st_size))
                except ValueError:
                    continue  # not one of ours: never read, never deleted
        for _, key, size in sorted(found):
            for old in self.index.add(key, size):
                _unlink(self.path(old))

    @property
    def bytes_held(self) -> int:
        return self.index.bytes_held

    def contains(self, key: bytes) -> bool:
        with self.lock:
            return key in self.index or key in self.queued

    def room(self, evicted: bool = True) -> int:
        """How many more blocks the writer takes now, of blocks the pool drops or just computed (MAX_QUEUED_BYTES)."""
        limit = self.max_queued_writes if evicted else min(self.max_queued_writes, self.write_through_queued)
        return max(0, limit - len(self.queued))

    def put(self, key: bytes, payload: dict[str, torch.Tensor]) -> None:
        self.put_many([key], {name: tensor[None] for name, tensor in payload.items()})

    def put_many(self, keys: list[bytes], gathered: dict[str, torch.Tensor]) -> None:
        """Queue a step's blocks (block i: `keys[i]`, rows i of `gathered`, name -> [num_blocks, ...]) as one
        chunk for the writer; those past `room()` are dropped (never waited for)."""
        with self.lock:
            rows, seen = [], set()
            for i, key in enumerate(keys):  # two requests may compute the same block in one step: written once
                if key not in self.index and key not in self.queued and key not in seen:
                    rows.append((i, key))
                    seen.add(key)
            room = self.room()
            self.num_writes_dropped += max(0, len(rows) - room)
            rows = rows[:room]
            if not rows:
                return
            self.queued.update(key for _, key in rows)
            self.pending.update((key, (gathered, i)) for i, key in rows)
            self.writes.put_nowait((rows, gathered))

    def read(self, key: bytes) -> dict | None:
        """The block's payload, checked; None (and the file gone) when missing or bad. A block still queued for
        the writer is read from the queue."""
        with self.lock:
            waiting = self.pending.get(key)
            if waiting is not None:
                gathered, row = waiting
                return {name: tensor[row].clone() for name, tensor in gathered.items()}
            if key not in self.index:
                return None
            self.index.touch(key)
        path = self.path(key)
        try:
            payload = decode(path.read_bytes(), self.namespace, key, self.layout)
            os.utime(path)  # the LRU order on disk, for the next start
            return payload
        except FileNotFoundError:
            pass  # deleted under us (evicted by the writer, or by hand): a miss
        except (OSError, ValueError) as exc:
            self.num_bad_files += 1
            logger.warning(f"KV tier: skipping {path} ({exc}); its tokens are recomputed")
            _unlink(path)
        with self.lock:
            self.index.discard(key)
        return None

    def size(self, key: bytes) -> int | None:
        """The bytes of the block's file, None when the folder does not hold it."""
        with self.lock:
            return self.index.entries.get(key)

    def file_bytes(self, key: bytes) -> bytes | None:
        """The block's file as it is (a KV producer serves it; the consumer checks it), or None."""
        with self.lock:
            if key not in self.index:
                return None
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def adopt(self, key: bytes) -> bool:
        """Index the block file another process wrote into this folder since the scan (a KV producer sharing it):
        -> whether it is there. Its content is checked when it is read, as every file's."""
        with self.lock:
            if key in self.index or key in self.queued:
                return True
        try:
            size = self.path(key).stat().st_size
        except FileNotFoundError:
            return False
        with self.lock:
            evicted = self.index.add(key, size)
        for old in evicted:
            _unlink(self.path(old))
        return True

    def receive(self, key: bytes, data: bytes) -> None:
        """Keep a block file fetched from a KV producer; ValueError (nothing kept) unless it is this model's block
        `key`, whole (the checks every read makes)."""
        decode(data, self.namespace, key, self.layout)
        header_len = 8 + int.from_bytes(data[:8], "little")
        self.write(key, np.frombuffer(memoryview(data)[header_len:], dtype=np.uint8), header=data[:header_len])

    def write(self, key: bytes, data: np.ndarray, header: bytes | None = None) -> None:
        """One block's file from its bytes (a row of `BlockLayout.rows`)."""
        path = self.path(key)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        header = header or self.layout.header({"format": FORMAT, "namespace": self.namespace.hex(),
                                               "key": key.hex(), "checksum": checksum(data)})
        with open(temp, "wb") as f:
            f.write(header)
            f.write(data)
        size = len(header) + data.nbytes
        os.replace(temp, path)  # atomic: the real name only ever holds a whole block
        with self.lock:
            evicted = self.index.add(key, size)
        for old in evicted:
            _unlink(self.path(old))
        self.num_bytes_written += size if key not in evicted else 0

    def close(self, timeout: float = 10.0) -> None:
        """Land the queued writes and end the writer thread (a thread that used torch must not outlive the
        interpreter: at exit that aborts the process)."""
        self.flush(timeout)
        if self.writer.is_alive():
            self.writes.put(None)
            self.writer.join(timeout)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the queued writes landed (tests, a clean shutdown) -> whether they did in time."""
        deadline = time.monotonic() + timeout
        while self.writes.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


def lowest_priority() -> None:
    """Run the calling thread at the lowest OS priority (Linux: a thread's own nice value), so the writer uses
    the cores only when the step's threads leave them idle. Its work (checksum, serialize, write) runs no torch
    op, so it starts no intra-op threads of its own."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere a thread id is no process id: left as is
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _write_loop(writes: queue.Queue, store_ref) -> None:
    """The writer thread: one queued chunk (a step's blocks) at a time, until the store is gone."""
    lowest_priority()
    while True:
        chunk = writes.get()
        store = store_ref() if chunk is not None else None
        try:
            if store is None:
                return
            rows, gathered = chunk
            try:
                data = store.layout.rows(gathered)
                for i, key in rows:
                    store.write(key, data[i])
            except Exception as exc:  # noqa: BLE001 - a failed write loses its blocks, never the engine
                logger.warning(f"KV tier: writing blocks to {store.folder} failed ({exc})")
            finally:
                with store.lock:
                    store.queued.difference_update(key for _, key in rows)
                    for _, key in rows:
                        store.pending.pop(key, None)
        finally:
            del store, chunk
            writes.task_done()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class TieredStore:
    """Host memory over disk, as the KV tier sees it (core.kv_tier.TierStore). Blocks the pool drops go to host
    memory (when `host_is_tier`), computed blocks go to disk; a disk hit is kept in host memory too (without a
    host tier, a small read cache: a request that waits for blocks re-reads nothing)."""

    def __init__(self, host: HostStore, disk: DiskStore | None, host_is_tier: bool):
        self.host = host
        self.disk = disk
        self.host_is_tier = host_is_tier
        self.num_bytes_read = 0
        self.num_disk_reads = 0
        self.read_seconds = 0.0
        self.num_host_bytes_written = 0

    def wants(self, key: bytes, evicted: bool) -> bool:
        if self._to_host(key, evicted):
            return True
        return self.disk is not None and not self.disk.contains(key)

    def _to_host(self, key: bytes, evicted: bool) -> bool:
        return evicted and self.host_is_tier and key not in self.host

    def admit(self, saves: list[tuple[int, bytes, bool]]) -> list[tuple[int, bytes, bool]]:
        """The saves (block id, key, evicted) worth reading out of the pool now: those for host memory, and as
        many for the disk as its writer takes; the others are dropped (and counted) before any copy is made."""
        rooms = (self.disk.room(evicted=False), self.disk.room(evicted=True)) if self.disk is not None else (0, 0)
        admitted, taken = [], 0
        for save in saves:
            if self._to_host(save[1], save[2]):
                admitted.append(save)
            elif taken < rooms[save[2]]:
                admitted.append(save)
                taken += 1
            elif self.disk is not None:
                self.disk.num_writes_dropped += 1
        return admitted

    def put(self, key: bytes, payload: dict[str, torch.Tensor], evicted: bool) -> None:
        self.put_many([(key, evicted)], {name: tensor[None] for name, tensor in payload.items()})

    def put_many(self, saves: list[tuple[bytes, bool]], gathered: dict[str, torch.Tensor]) -> None:
        """A step's saves (key, evicted), block i in rows i of `gathered` (name -> [num_blocks, ...]): dropped
        blocks to host memory (when it is a tier), all of them to the disk's writer."""
        for i, (key, evicted) in enumerate(saves):
            if self._to_host(key, evicted):
                payload = {name: tensor[i] for name, tensor in gathered.items()}
                self.host.put(key, payload)
                self.num_host_bytes_written += payload_nbytes(payload)
        if self.disk is not None:
            self.disk.put_many([key for key, _ in saves], gathered)

    def fetch(self, key: bytes) -> dict | None:
        payload = self.host.get(key)
        if payload is not None or self.disk is None:
            return payload
        start = time.perf_counter()
        payload = self.disk.read(key)
        if payload is not None:
            self.read_seconds += time.perf_counter() - start
            self.num_disk_reads += 1
            self.num_bytes_read += payload_nbytes(payload)
            self.host.put(key, payload)
        return payload

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the disk's queued writes landed (the writer runs at the lowest priority: on a busy host a
        step's blocks can still be queued when a run ends) -> whether they did in time."""
        return self.disk.flush(timeout) if self.disk is not None else True

    def stats(self) -> dict:
        disk = self.disk
        return {"kv_tier_host_bytes": self.host.index.bytes_held,
            "kv_tier_disk_bytes": disk.bytes_held if disk is not None else 0,
            "kv_tier_bytes_written": self.num_host_bytes_written + (disk.num_bytes_written if disk else 0),
            "kv_tier_bytes_read": self.num_bytes_read,
            "kv_tier_disk_reads": self.num_disk_reads,
            "kv_tier_read_seconds": self.read_seconds,
            "kv_tier_writes_dropped": disk.num_writes_dropped if disk is not None else 0,
            "kv_tier_bad_files": disk.num_bad_files if disk is not None else 0}
