"""The CPU weights moved into memory the kernel backs with 2 MB pages (transparent huge pages), once, at load.

Why: a decode step at a few rows streams every weight once, and with 4 KB pages that stream crosses a page every
4 KB: a TLB miss and a restart of the hardware prefetchers at each. On an AMD EPYC Zen 4 (`avx512_bf16`, 2 threads)
the default model's linears at one row read 1.12-1.22x faster from 2 MB pages than from the 4 KB pages torch's
allocations get (the same weights, in one process, by turns; bfloat16 and float32 alike). Linux gives a process's
anonymous memory 2 MB pages where it asks (`madvise(MADV_HUGEPAGE)`, the setting most distributions ship) or
always; torch's allocations do not ask, and a weight under 2 MB never fills an aligned 2 MB page of its own.

So the weights' storages are copied into one private anonymous mapping advised for huge pages, each at a page
boundary, and every tensor that viewed a storage is pointed at its copy in place (`Tensor.set_`: the same
parameter objects, ties and views kept, as `.data =` keeps them); the old storages are freed as they are copied.
The engine's caches of a weight (packed copies, compiled calls' pointers) follow its address and are made again.
Where Linux does not offer huge pages (`never`, or no such setting: another OS), or a checkpoint read from its
file would not fit in memory twice, nothing moves.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Iterable

import torch

from paged_hf.loader.mapped_weights import in_file_mappings
from paged_hf.worker.model_info import free_memory_bytes

HUGE_PAGE = 2 << 20
PAGE = 4096
#: storages smaller than this stay where they are (norms, biases: nothing a stream of them gains)
MIN_BYTES = 64 << 10
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
#: the mappings made here, while a tensor reads one: (the mapping, its first address, its last + 1). A storage in
#: one stays where it is (a model wrapped again: copying it anew was ~1.2 s of a float32 default-model `wrap`)
_MAPPINGS: list[tuple[weakref.ref, int, int]] = []


def huge_pages_mode(path: str = THP_SETTING) -> str | None:
    """The kernel's setting for anonymous memory, "always", "madvise" or "never"; None where there is none."""
    try:
        with open(path) as setting:
            text = setting.read()
    except OSError:
        return None
    chosen = text[text.find("[") + 1: text.find("]")] if "[" in text else ""
    return chosen or None


def movable(tensor: torch.Tensor) -> bool:
    """A plain CPU tensor with memory of its own kind (no subclass: weight shards, quantized tensor types)."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
            and not tensor.is_meta and tensor.numel() > 0)


def into_huge_pages(tensors: Iterable[torch.Tensor], mode: str | None = None, available: int | None = None) -> int:
    """Every storage of `tensors` of at least MIN_BYTES copied into one mapping advised for 2 MB pages, each
    tensor pointed at its storage's copy (same offset, shape and strides). `mode`: the kernel's setting,
    `available`: the memory free for the copies (both read when None). Returns the bytes moved (0 where huge
    pages are not offered, or the copies would need more memory than is free)."""
    mode = huge_pages_mode() if mode is None else mode
    if mode not in ("always", "madvise"):
        return 0
    views: dict[int, list[torch.Tensor]] = {}  # a storage's address -> the tensors viewing it
    storages: dict[int, torch.UntypedStorage] = {}
    for given in tensors:
        # a view's base too (it would hold the old storage: `pack_int4`'s weights are views of a [n, k/32, 16] one)
        for tensor in (given, given._base) if given._base is not None else (given,):
            if not movable(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() < MIN_BYTES:
                continue
            pointer = storage.data_ptr()
            if _in_mappings(pointer):
                continue
            storages.setdefault(pointer, storage)
            if all(view is not tensor for view in views.setdefault(pointer, [])):
                views[pointer].append(tensor)
    if not storages:
        return 0
    if _new_bytes(storages) > (free_memory_bytes(torch.device("cpu")) if available is None else available):
        return 0  # (a checkpoint larger than memory, read from its file's pages: left there)
    sizes = {pointer: -(-storage.nbytes() // PAGE) * PAGE for pointer, storage in storages.items()}
    used = sum(sizes.values())
    arena = mmap.mmap(-1, used + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = _address(arena)
    start = -address % HUGE_PAGE  # the first 2 MB boundary in it
    _MAPPINGS[:] = [entry for entry in _MAPPINGS if entry[0]() is not None]
    _MAPPINGS.append((weakref.ref(arena), address, address + len(arena)))
    if used >= HUGE_PAGE:  # (the last partial 2 MB stays in small pages: a huge one there would be mostly unused)
        arena.madvise(mmap.MADV_HUGEPAGE, start, used // HUGE_PAGE * HUGE_PAGE)
    offset = start
    for pointer in list(storages):
        storage = storages.pop(pointer)  # (held no longer than its copy takes: the old memory goes as it is copied)
        copy = torch.frombuffer(arena, dtype=torch.uint8, count=storage.nbytes(), offset=offset).untyped_storage()
        copy.copy_(storage)
        del storage
        for tensor in views.pop(pointer):
            with torch.inference_mode() if tensor.is_inference() else torch.no_grad():
                tensor.set_(copy, tensor.storage_offset(), tensor.shape, tensor.stride())
        offset += sizes[pointer]
    return used


def _in_mappings(pointer: int) -> bool:
    return any(start <= pointer < end and mapping() is not None for mapping, start, end in _MAPPINGS)


def _new_bytes(storages: dict[int, torch.UntypedStorage]) -> int:
    """What the copies need beyond the memory they free as they are made: the storages that read a file's mapping
    (its pages are the page cache's, which the system can drop again; the copies' it cannot) and the largest other
    one."""
    mapped = in_file_mappings() or (lambda pointer: False)
    in_files = [mapped(pointer) for pointer in storages]
    sizes = [storage.nbytes() for storage in storages.values()]
    return sum(size for size, mapped in zip(sizes, in_files) if mapped) + max(
        (size for size, mapped in zip(sizes, in_files) if not mapped), default=0)


def _address(arena: mmap.mmap) -> int:
    """Where the mapping starts in memory."""
    view = torch.frombuffer(arena, dtype=torch.uint8, count=1)
    return view.data_ptr()
