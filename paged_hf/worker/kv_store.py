"""Where the KV tier keeps blocks: host memory and a directory of safetensors files, each LRU within its bytes.

A payload is one block's K/V for every layer (and a quantized cache's scales), as CPU tensors by name. On disk
one block is one file, `<key hex>.safetensors`, written by one background thread from a bounded queue (a full
queue drops the write: a step never waits for the disk) to a temporary name and renamed, so a crash never leaves
a torn block under a real name. Its metadata holds the format, the namespace, the key and a checksum of the
tensors; a file that fails any check (truncated, overwritten, another model's, renamed) is deleted and counts as
a miss, never loaded as K/V. The files' modification times are the LRU order, so it survives a restart.

Why not LMCache: it installs on CPU (0.5.6) but its paged-memory connector needs `torch.cuda.Stream` and its
`cuda_ops` need libc10_cuda; only its no-op mock connector runs without CUDA (docs/prefix_caching.md).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
import weakref
import zlib
from pathlib import Path

import safetensors.torch
import torch
from transformers.utils import logging

from paged_hf.core.kv_tier import LRUIndex

logger = logging.get_logger(__name__)

FORMAT = "paged_hf-kv/1"
SUFFIX = ".safetensors"
STALE_TEMP_SECONDS = 600  # temporary files older than this are leftovers of a crash


def payload_nbytes(payload: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def checksum(payload: dict[str, torch.Tensor]) -> str:
    """CRC-32 of the names and bytes: it finds torn and flipped bytes at ~7 GB/s (blake2b: ~1.4). Not a defence
    against someone who can write the folder: they could as well write a valid file."""
    crc = 0
    for name in sorted(payload):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(payload[name].contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def encode(payload: dict[str, torch.Tensor], namespace: bytes, key: bytes) -> bytes:
    metadata = {"format": FORMAT, "namespace": namespace.hex(), "key": key.hex(), "checksum": checksum(payload)}
    return safetensors.torch.save({n: t.contiguous() for n, t in payload.items()}, metadata=metadata)


def decode(data: bytes, namespace: bytes, key: bytes, expected: dict[str, tuple[torch.dtype, tuple]]) -> dict:
    """The payload in `data`; ValueError unless it is this namespace's block `key`, whole and of the cache's shapes."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError("truncated header")
    try:
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        payload = safetensors.torch.load(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
        raise ValueError(f"unreadable: {exc}") from None
    if (metadata.get("format"), metadata.get("namespace"), metadata.get("key")) != (FORMAT, namespace.hex(), key.hex()):
        raise ValueError("another format, model or key")
    if {n: (t.dtype, tuple(t.shape)) for n, t in payload.items()} != expected:
        raise ValueError("tensors of other names, dtypes or shapes than the cache's")
    if metadata.get("checksum") != checksum(payload):
        raise ValueError("checksum mismatch")
    return payload


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
        if key in self.index:
            self.payloads[key] = payload


class DiskStore:
    """One safetensors file per block in `folder`, at most `capacity` bytes of them (LRU by modification time).
    The engine thread reads; one writer thread writes and deletes. The index is shared under a lock."""

    def __init__(self, folder: str | os.PathLike, capacity: int, namespace: bytes,
                 expected: dict[str, tuple[torch.dtype, tuple]], max_queued_writes: int = 256):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.expected = expected
        self.index = LRUIndex(capacity)
        self.lock = threading.Lock()
        self.queued: set[bytes] = set()  # keys waiting for the writer
        self.num_bytes_written = 0
        self.num_writes_dropped = 0
        self.num_bad_files = 0
        self._scan()
        self.writes: queue.Queue = queue.Queue(max_queued_writes)
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

    def put(self, key: bytes, payload: dict[str, torch.Tensor]) -> None:
        """Queue a write; dropped (never waited for) when the queue is full."""
        with self.lock:
            if key in self.index or key in self.queued:
                return
            try:
                self.writes.put_nowait((key, payload))
            except queue.Full:
                self.num_writes_dropped += 1
                return
            self.queued.add(key)

    def read(self, key: bytes) -> dict | None:
        """The block's payload, checked; None (and the file gone) when missing or bad."""
        with self.lock:
            if key not in self.index:
                return None
            self.index.touch(key)
        path = self.path(key)
        try:
            payload = decode(path.read_bytes(), self.namespace, key, self.expected)
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

    def write(self, key: bytes, payload: dict[str, torch.Tensor]) -> None:
        data = encode(payload, self.namespace, key)
        path = self.path(key)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(temp, "wb") as f:
            f.write(data)
        os.replace(temp, path)  # atomic: the real name only ever holds a whole block
        with self.lock:
            evicted = self.index.add(key, len(data))
        for old in evicted:
            _unlink(self.path(old))
        self.num_bytes_written += len(data) if key not in evicted else 0

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


def _write_loop(writes: queue.Queue, store_ref) -> None:
    """The writer thread: one queued block at a time, until the store is gone."""
    while True:
        item = writes.get()
        store = store_ref() if item is not None else None
        try:
            if store is None:
                return
            key, payload = item
            try:
                store.write(key, payload)
            except Exception as exc:  # noqa: BLE001 - a failed write loses one block, never the engine
                logger.warning(f"KV tier: writing a block to {store.folder} failed ({exc})")
            finally:
                with store.lock:
                    store.queued.discard(key)
        finally:
            del store
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
        if evicted and self.host_is_tier and key not in self.host:
            return True
        return self.disk is not None and not self.disk.contains(key)

    def put(self, key: bytes, payload: dict[str, torch.Tensor], evicted: bool) -> None:
        if evicted and self.host_is_tier and key not in self.host:
            self.host.put(key, payload)
            self.num_host_bytes_written += payload_nbytes(payload)
        if self.disk is not None:
            self.disk.put(key, payload)

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

    def stats(self) -> dict:
        disk = self.disk
        return {
            "kv_tier_host_bytes": self.host.index.bytes_held,
            "kv_tier_disk_bytes": disk.bytes_held if disk is not None else 0,
            "kv_tier_bytes_written": self.num_host_bytes_written + (disk.num_bytes_written if disk else 0),
            "kv_tier_bytes_read": self.num_bytes_read,
            "kv_tier_disk_reads": self.num_disk_reads,
            "kv_tier_read_seconds": self.read_seconds,
            "kv_tier_writes_dropped": disk.num_writes_dropped if disk is not None else 0,
            "kv_tier_bad_files": disk.num_bad_files if disk is not None else 0,
        }
