"""Tensors that still read a checkpoint file's memory mapping, copied into the process's own memory once a
quantization at load has replaced the weights around them.

Why: transformers loads a safetensors checkpoint whose dtype is the one asked for without copying it: every
tensor reads the file's one mapping, which stays while any of them is alive. Quantizing at load reads each float
weight once (its pages become resident) and replaces it, but the embeddings, norms and biases that stay keep the
whole mapping, and with it every page read: a 1B Llama folder in bfloat16 quantized to w4a8 stayed at 3.3x its
quantized weights' bytes (the 2 GB file resident; measured). Copied out, the mapping goes with the last tensor
that read it. Where the process's mappings cannot be read (no /proc/self/maps: not Linux) nothing is copied.
"""

from __future__ import annotations

import bisect

import torch


def file_mappings() -> list[tuple[int, int]]:
    """(start, end) of each of this process's mappings of a file, sorted; [] where they cannot be read."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                # address perms offset device inode path: a file's mapping has an inode and a path that is not
                # a pseudo one ("[heap]", "[stack]", ...)
                if len(fields) == 6 and fields[4] != "0" and not fields[5].startswith("["):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return sorted(ranges)


def in_file_mappings():
    """-> a test of an address: whether it lies in one of this process's mappings of a file (read now); None where
    the mappings cannot be read."""
    ranges = file_mappings()
    if not ranges:
        return None
    starts = [start for start, _ in ranges]

    def mapped(pointer: int) -> bool:
        index = bisect.bisect_right(starts, pointer) - 1
        return index >= 0 and pointer < ranges[index][1]

    return mapped


def copy_out_of_files(model: torch.nn.Module) -> int:
    """Every parameter and buffer of `model` whose memory lies in a file's mapping given memory of its own (tied
    and other views of one storage still share their copy). Returns the bytes copied."""
    mapped = in_file_mappings()
    if mapped is None:
        return 0
    copies: dict[int, torch.UntypedStorage] = {}  # the file's storage (its address) -> its copy
    copied = 0
    for tensor in [*model.parameters(), *model.buffers()]:  # (a tied tensor once)
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in copies:
            if not mapped(pointer):
                continue
            copies[pointer] = storage.clone()
            copied += storage.nbytes()
        with torch.no_grad():  # the same view of the copy, in place: ties and references keep holding it
            tensor.set_(copies[pointer], tensor.storage_offset(), tensor.shape, tensor.stride())
    return copied
