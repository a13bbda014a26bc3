"""Moves block contents between the paged cache and the KV tier (`core/kv_tier.py`, `worker/kv_tier/store.py`), and
makes what the tier's keys stand on: the model's fingerprint (the namespace) and the adapters' content hashes.

Before each forward the runner makes the tier's transfers: it reads the blocks to save (dropped by the pool or
just computed) in one gather per layer and hands them to the store, then, after the step's copy-on-write copies,
writes the loaded payloads into their fresh blocks in one scatter per layer.

The fingerprint hashes the model's config, every weight's name, dtype and shape and a strided sample of each
weight's bytes (all of a small one): a different checkpoint or fine-tune changes the samples, and hashing every
byte of a large model would cost seconds at each start. Weights changed in place after the engine was built
(training the live model) are not seen: a new generator takes a new fingerprint.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile

import torch

from paged_hf.config import PagedConfig
from paged_hf.core.kv_tier import KVTier, TierTransfers
from paged_hf.core.request import Request
from paged_hf.kernels.quant import as_bytes
from paged_hf.worker.distributed import is_multi_rank
from paged_hf.worker.kv_tier.store import WRITE_THROUGH_QUEUED, DiskStore, HostStore, TieredStore
from paged_hf.worker.paged_cache import PagedCache

GIB = 1 << 30
SAMPLE_BYTES = 1 << 16  # bytes hashed of each weight (all of a smaller one)
READ_CACHE_BYTES = 64 << 20  # disk hits kept in memory when there is no host tier


def _update_with_tensor(digest, tensor: torch.Tensor) -> None:
    digest.update(f"{tuple(tensor.shape)}:{tensor.dtype}".encode())
    if tensor.device.type == "meta":
        return
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() * flat.element_size() // SAMPLE_BYTES)
    digest.update(flat[::step].contiguous().cpu().view(torch.uint8).numpy())


def model_fingerprint(model: torch.nn.Module, model_dtype: torch.dtype, kv_dtype: torch.dtype,
                      block_size: int) -> bytes:
    """What a block's K/V depend on besides its tokens and adapter: weights, config, dtypes, block size."""
    digest = hashlib.blake2b(digest_size=16)
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(f"|{model_dtype}|{kv_dtype}|{block_size}|".encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        _update_with_tensor(digest, tensor)
    return digest.digest()


def adapter_digest(lora) -> bytes:
    """An adapter's content: its folder's hash when read from files, else its weights' bytes."""
    if getattr(lora, "content_hash", None):
        return str(lora.content_hash).encode()
    digest = hashlib.blake2b(digest_size=16)
    for path, (a, b) in sorted(lora.weights.items()):
        digest.update(path.encode())
        for tensor in (a, b):
            digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy())
    return digest.digest()


class RequestKeys:
    """A request's stable key: its adapter's content hash and its cache salt, length-prefixed (as
    core.kv_cache_manager.request_cache_key, but with no per-process adapter version)."""

    def __init__(self):
        self.digests: dict[tuple[str, int], bytes] = {}  # (adapter name, version) -> content hash

    def __call__(self, request: Request) -> bytes:
        parts = []
        lora = request.lora
        if lora is not None:
            version = (lora.name, lora.version)
            if version not in self.digests:
                self.digests[version] = adapter_digest(lora)
            parts.append(b"adapter:" + self.digests[version])
        elif request.adapter is not None:
            parts.append(b"adapter_name:" + request.adapter.encode())
        if request.cache_salt is not None:
            parts.append(b"salt:" + request.cache_salt.encode())
        return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


def _layer_tensors(cache: PagedCache) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor [num_blocks, ...]) of every per-block tensor of the cache, bytes for fp8."""
    tensors = []
    for layer, (key, value) in enumerate(zip(cache.key_cache, cache.value_cache)):
        tensors += [(f"k.{layer}", as_bytes(key)), (f"v.{layer}", as_bytes(value))]
        scales = cache.scales[layer]
        if scales is not None:
            tensors += [(f"ks.{layer}", scales.key), (f"vs.{layer}", scales.value)]
    return tensors


def expected_payload(cache: PagedCache) -> dict[str, tuple[torch.dtype, tuple]]:
    """name -> (dtype, shape) of one block's payload for this cache."""
    return {name: (tensor.dtype, tuple(tensor.shape[1:])) for name, tensor in _layer_tensors(cache)}


def gather_blocks(cache: PagedCache, block_ids: list[int]) -> dict[str, torch.Tensor]:
    """name -> the blocks' rows [len(block_ids), ...] on the CPU: one gather per layer tensor for all the blocks
    of a step (a copy: the pool may overwrite the blocks right after)."""
    gathered, indices = {}, {}
    for name, tensor in _layer_tensors(cache):
        if tensor.device not in indices:
            indices[tensor.device] = torch.tensor(block_ids, dtype=torch.long, device=tensor.device)
        gathered[name] = tensor.index_select(0, indices[tensor.device]).cpu()
    return gathered


def scatter_blocks(cache: PagedCache, block_ids: list[int], payloads: list[dict[str, torch.Tensor]]) -> None:
    indices = {}
    for name, tensor in _layer_tensors(cache):
        if tensor.device not in indices:
            indices[tensor.device] = torch.tensor(block_ids, dtype=torch.long, device=tensor.device)
        rows = torch.stack([payload[name] for payload in payloads]).to(tensor.device)
        tensor.index_copy_(0, indices[tensor.device], rows)


class KVOffloader:
    """The runner's side of the tier: saves before the step's copies, loads after them."""

    def __init__(self, cache: PagedCache, tier: KVTier, store: TieredStore):
        self.cache = cache
        self.tier = tier
        self.store = store

    def save_blocks(self) -> TierTransfers:
        """Read the blocks to save into the store -> the transfers, whose loads `load_blocks` makes. Blocks the
        store would drop (its writer is behind) are not even read: a step never waits for the disk."""
        transfers = self.tier.take_transfers()
        self._save(transfers.saves)
        return transfers

    def save_computed_blocks(self) -> None:
        """After a step's forward: the blocks it filled go to the store now, not before the next step's (an idle
        engine has no next step, and a KV producer's answer waits for its prompt's blocks)."""
        self._save(self.tier.take_saves())

    def _save(self, pending: dict[int, tuple[bytes, bool]]) -> None:
        if pending:
            saves = self.store.admit([(block_id, *save) for block_id, save in pending.items()])
            if saves:
                gathered = gather_blocks(self.cache, [block_id for block_id, _, _ in saves])
                self.store.put_many([(key, evicted) for _, key, evicted in saves], gathered)

    def load_blocks(self, transfers: TierTransfers) -> None:
        if transfers.loads:
            block_ids = list(transfers.loads)
            scatter_blocks(self.cache, block_ids, [transfers.loads[i].payload for i in block_ids])


def make_kv_offload(model: torch.nn.Module, model_dtype: torch.dtype, cache: PagedCache,
                    config: PagedConfig) -> KVOffloader | None:
    """The tier the config asks for (`kv_offloading_size` GiB of host memory, `kv_cache_dir` of at most
    `kv_cache_dir_size` GiB), or None."""
    host_bytes = int((config.kv_offloading_size or 0) * GIB)
    transfer = config.kv_transfer_config
    if not host_bytes and not config.kv_cache_dir and transfer is None:
        return None
    if not config.enable_prefix_caching:
        raise ValueError("kv_offloading_size / kv_cache_dir / kv_transfer_config need enable_prefix_caching=True "
                         "(the tier extends it)")
    if is_multi_rank():
        raise ValueError("kv_offloading_size / kv_cache_dir / kv_transfer_config: not supported with tensor "
                         "parallelism yet")
    kv_dtype = cache.key_cache[0].dtype
    namespace = model_fingerprint(model, model_dtype, kv_dtype, cache.block_size)
    disk = None
    folder = config.kv_cache_dir or (transfer and temporary_folder("paged_hf_kv_transfer_"))
    if folder:
        producer = transfer is not None and transfer.is_producer  # every computed block, none dropped
        disk = DiskStore(folder, int(config.kv_cache_dir_size * GIB), namespace, expected_payload(cache),
                         write_through_queued=(1 << 62) if producer else WRITE_THROUGH_QUEUED)
    store = TieredStore(HostStore(host_bytes or READ_CACHE_BYTES), disk, host_is_tier=bool(host_bytes))
    return KVOffloader(cache, KVTier(namespace, store, RequestKeys(), cache.block_size), store)


def temporary_folder(prefix: str) -> str:
    """A fresh folder, removed at exit (after the tier's writer landed its writes: registered before it)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, True)
    return folder
