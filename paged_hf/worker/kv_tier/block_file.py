"""One KV block as a file: a safetensors header (the cache's tensors, the format, namespace, key and checksum
in its metadata) and the block's bytes. The KV tier's directory holds these files, and disaggregated
prefill/decode sends them as they are (`decode` checks one before anything is loaded from it)."""

from __future__ import annotations

import json
import zlib

import numpy as np
import safetensors.torch
import torch

FORMAT = "paged_hf-kv/2"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.uint8: "U8", torch.int8: "I8"}


def payload_nbytes(payload: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


class BlockLayout:
    """One block's file: a safetensors header (the cache's tensors, in the cache's order, their bytes back to
    back; the metadata) and the bytes. Every block of a cache has the same tensor entries, so a file is written
    as one header and one row of bytes, with no work per tensor (the writer thread holds the GIL less)."""

    def __init__(self, expected: dict[str, tuple[torch.dtype, tuple]]):
        self.names = list(expected)
        self.entries, offset = {}, 0
        for name, (dtype, shape) in expected.items():
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            self.entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                                  "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        self.nbytes = offset

    def header(self, metadata: dict[str, str]) -> bytes:
        text = json.dumps({"__metadata__": metadata, **self.entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        return len(text).to_bytes(8, "little") + text

    def rows(self, gathered: dict[str, torch.Tensor]):
        """[num_blocks, nbytes] uint8 (numpy): each block's bytes in file order, one copy for a chunk of blocks
        (numpy: no torch op, so the writer thread starts no intra-op threads of its own)."""
        num = next(iter(gathered.values())).shape[0]
        parts = [gathered[name].reshape(num, -1).view(torch.uint8).numpy() for name in self.names]
        return np.concatenate(parts, axis=1)


def checksum(data) -> str:
    """CRC-32 of a block's bytes: it finds torn and flipped bytes at ~7 GB/s (blake2b: ~1.4). Not a defence
    against someone who can write the folder: they could as well write a valid file."""
    return f"{zlib.crc32(data):08x}"


def decode(data: bytes, namespace: bytes, key: bytes, layout: BlockLayout) -> dict:
    """The payload in `data`; ValueError unless it is this namespace's block `key`, whole and of the cache's shapes."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError("truncated header")
    try:
        header = json.loads(data[8 : 8 + header_len])
        metadata = header.pop("__metadata__")
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
        raise ValueError(f"unreadable: {exc}") from None
    if (metadata.get("format"), metadata.get("namespace"), metadata.get("key")) != (FORMAT, namespace.hex(), key.hex()):
        raise ValueError("another format, model or key")
    if header != layout.entries:
        raise ValueError("tensors of other names, dtypes or shapes than the cache's")
    if len(data) != 8 + header_len + layout.nbytes:
        raise ValueError("truncated or padded data")
    if metadata.get("checksum") != checksum(memoryview(data)[8 + header_len :]):
        raise ValueError("checksum mismatch")
    return safetensors.torch.load(data)
