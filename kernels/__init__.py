"""Attention and KV-write kernels behind one small interface: plan once per step, run once per layer.

`torch` is pure PyTorch (the CPU path, and the reference every other kernel is tested against);
`flashinfer` runs on NVIDIA GPUs and is imported only when selected.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .base import AttentionKernel
from .torch_kernel import TorchKernel

logger = logging.get_logger(__name__)


def select_kernel(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernel:
    """`auto`: FlashInfer on CUDA when it imports and supports the shapes, otherwise torch."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        logger.info(f"paged_hf attention backend: torch ({'asked for' if name == 'torch' else f'device {device.type}'})")
        return TorchKernel()
    if name == "flashinfer" or (name == "auto" and device.type == "cuda"):
        try:
            from .flashinfer import FlashInferKernel  # noqa: PLC0415 (lazy: never imported on CPU)

            reason = FlashInferKernel.unsupported_reason(device, dtype, head_dim)
        except ImportError as error:
            reason = f"flashinfer is not importable ({error})"
        if reason is None:
            logger.info("paged_hf attention backend: flashinfer")
            return FlashInferKernel()
        if name == "flashinfer":
            raise ValueError(f"attention_backend='flashinfer' cannot be used: {reason}")
        logger.info(f"paged_hf attention backend: torch ({reason})")
    return TorchKernel()


__all__ = ["AttentionKernel", "TorchKernel", "select_kernel"]
