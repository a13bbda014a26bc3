"""Which attention kernel serves a model: the kernels share one small interface (`base.AttentionKernel`: plan once
per step, run once per layer).

`torch` is pure PyTorch (runs anywhere, and is the reference every other kernel is tested against); `cpu` is
the torch kernel with decode attention compiled for this machine (built on first use, cached); `flashinfer`
runs on NVIDIA GPUs and is imported only when selected.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from paged_hf.kernels.base import AttentionKernel
from paged_hf.kernels.torch_kernel import TorchKernel

logger = logging.get_logger(__name__)


def select_kernel(name: str, devices: list[torch.device], dtype: torch.dtype, head_dims: list[int],
                  kv_dtype: torch.dtype | None = None, value_head_dims: list[int] | None = None,
                  sinks: bool = False, chunked: bool = False, distance_bias: bool = False,
                  sparse: bool = False, alibi: bool = False) -> AttentionKernel:
    """`auto`: FlashInfer on CUDA, the compiled CPU kernel on CPU, each when it is usable for every layer
    (`devices`, `head_dims` of the keys, `value_head_dims`: per layer), the cache's storage dtype `kv_dtype`
    (None: the model's `dtype`), attention sinks, chunked attention, biases by distance, keys selected per query
    and ALiBi (`sinks`, `chunked`, `distance_bias`, `sparse`, `alibi`: some layer has them); otherwise torch, which
    computes all of them. Naming a kernel that cannot be used is a ValueError."""
    if name == "torch":
        logger.info("paged_hf attention backend: torch (asked for)")
        return TorchKernel()
    device_types = sorted({torch.device(d).type for d in devices})
    device = torch.device(devices[0]) if len(device_types) == 1 else None
    only_torch = _needs_torch(head_dims, value_head_dims, sinks, chunked, distance_bias, sparse, alibi)
    if device is None:
        kernel, reason = None, f"the layers span devices of several types ({', '.join(device_types)})"
    elif only_torch is not None:
        kernel, reason = None, only_torch
    elif name == "cpu" or (name == "auto" and device.type == "cpu"):
        kernel, reason = _try_cpu(device, dtype, head_dims, kv_dtype)
    elif name == "flashinfer" or (name == "auto" and device.type == "cuda"):
        kernel, reason = _try_flashinfer(device, dtype, head_dims, kv_dtype)
    else:
        kernel, reason = None, f"no kernel of its own for device {device.type}"
    if kernel is not None:
        logger.info(f"paged_hf attention backend: {kernel.name}")
        return kernel
    if name != "auto":
        raise ValueError(f"attention_backend={name!r} cannot be used: {reason}")
    logger.info(f"paged_hf attention backend: torch ({reason})")
    return TorchKernel()


def _needs_torch(head_dims: list[int], value_head_dims: list[int] | None, sinks: bool, chunked: bool,
                 distance_bias: bool = False, sparse: bool = False, alibi: bool = False) -> str | None:
    """What only the torch kernel computes: K and V of different widths (MLA), attention sinks, chunks, biases by
    distance, keys selected per query, ALiBi."""
    if value_head_dims is not None and list(value_head_dims) != list(head_dims):
        return "K and V have different head_dims (MLA): the torch kernel serves them"
    if sinks:
        return "attention sinks: the torch kernel serves them"
    if chunked:
        return "chunked attention (Llama 4): the torch kernel serves it"
    if distance_bias:
        return "a learned bias by distance in the scores (Inkling): the torch kernel serves it"
    if sparse:
        return "sparse attention over the keys an indexer selects: the torch kernel serves it"
    if alibi:
        return "ALiBi (BLOOM, MPT): the torch kernel serves it"
    return None


def _try_cpu(device, dtype, head_dims, kv_dtype) -> tuple[AttentionKernel | None, str | None]:
    from paged_hf.kernels.cpu_kernel import CpuKernel  # noqa: PLC0415
    from paged_hf.kernels.native import NativeBuildError  # noqa: PLC0415

    reason = CpuKernel.unsupported_reason(device, dtype, head_dims, kv_dtype)
    if reason is not None:
        return None, reason
    try:
        return CpuKernel(dtype, head_dims, kv_dtype), None
    except NativeBuildError as error:
        logger.warning_once(f"paged_hf: the compiled CPU kernel is unavailable, using the torch kernel: {error}")
        return None, str(error)


def _try_flashinfer(device, dtype, head_dims, kv_dtype) -> tuple[AttentionKernel | None, str | None]:
    try:
        from paged_hf.kernels.flashinfer import FlashInferKernel  # noqa: PLC0415 (lazy: never imported on CPU)

        reasons = [FlashInferKernel.unsupported_reason(device, dtype, d, kv_dtype) for d in sorted(set(head_dims))]
        reason = next((r for r in reasons if r is not None), None)
    except ImportError as error:
        reason = f"flashinfer is not importable ({error})"
    return (FlashInferKernel() if reason is None else None), reason


__all__ = ["AttentionKernel", "TorchKernel", "select_kernel"]
