"""Which attention kernel serves a model: the one `attention_backend` names, or for "auto" the device's own, when
it serves every layer's `AttentionSpec`; otherwise the torch kernel, which serves them all.

The kernels share one small interface (`base.AttentionKernel`: plan once per step, run once per layer) and each
says what it does not compute (`unsupported_reason(spec)`). `torch` is pure PyTorch (runs anywhere, and is the
reference every other kernel is tested against); `cpu` is the torch kernel with its attention compiled for this
machine (built on first use, cached); `flashinfer` runs on NVIDIA GPUs and is imported only when selected.

Layers whose steps may carry bidirectional spans (`AttentionSpec.bidirectional_spans`, Gemma 3's images) get two
(`select_kernels`): the kernel chosen as for any model, for every step, and where it cannot compute spans the torch
kernel for the steps that carry some (a prefill through an image); every kernel writes and reads the same paged
layout, so decodes and text-only steps keep the fast kernel and an image step is never masked causally.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.utils import logging

from paged_hf.kernels.base import AttentionKernel
from paged_hf.kernels.spec import AttentionSpec
from paged_hf.kernels.torch_kernel import TorchKernel

logger = logging.get_logger(__name__)

#: attention_backend values, besides "auto"
BACKENDS = ("torch", "cpu", "flashinfer")


def select_kernel(name: str, specs: list[AttentionSpec]) -> AttentionKernel:
    """`auto`: FlashInfer on CUDA, the compiled CPU kernel on CPU, each when it serves every layer; otherwise
    torch. Naming a kernel that cannot serve the model is a ValueError that says why."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"attention_backend must be 'auto' or one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "torch" or not specs:
        logger.info(f"paged_hf attention backend: torch ({'asked for' if specs else 'no attention layers'})")
        return TorchKernel()
    device_types = sorted({torch.device(spec.device).type for spec in specs})
    wanted = name if name != "auto" else {"cpu": "cpu", "cuda": "flashinfer"}.get(device_types[0])
    if len(device_types) > 1:
        kernel, reason = None, f"the layers span devices of several types ({', '.join(device_types)})"
    elif wanted is None:
        kernel, reason = None, f"no kernel of its own for device {device_types[0]}"
    else:
        kernel, reason = _try(wanted, specs)
    if kernel is not None:
        logger.info(f"paged_hf attention backend: {kernel.name}")
        return kernel
    if name != "auto":
        raise ValueError(f"attention_backend={name!r} cannot be used: {reason}")
    logger.info(f"paged_hf attention backend: torch ({reason})")
    return TorchKernel()


def select_kernels(name: str, specs: list[AttentionSpec]) -> tuple[AttentionKernel, AttentionKernel | None]:
    """-> (the kernel of every step, the kernel of the steps that carry bidirectional spans, or None where the
    first computes those too). A quantized cache whose scales the two kernels would read differently (FlashInfer's
    one per tensor) takes the torch kernel for every step."""
    if not any(spec.bidirectional_spans for spec in specs):
        return select_kernel(name, specs), None
    kernel = select_kernel(name, [dataclasses.replace(spec, bidirectional_spans=False) for spec in specs])
    if all(kernel.unsupported_reason(spec) is None for spec in specs):
        return kernel, None
    if kernel.per_block_kv_scales != TorchKernel.per_block_kv_scales and any(spec.kv_dtype for spec in specs):
        logger.info("paged_hf attention backend: torch (bidirectional spans over a cache of per-tensor scales)")
        return TorchKernel(), None
    logger.info(f"paged_hf attention backend: {kernel.name}, torch for the steps with bidirectional spans")
    return kernel, TorchKernel()


def _try(name: str, specs: list[AttentionSpec]) -> tuple[AttentionKernel | None, str | None]:
    """The kernel `name` for these layers, or (None, why not)."""
    kernel_class = _kernel_class(name)
    reason = next((r for r in map(kernel_class.unsupported_reason, specs) if r is not None), None)
    if reason is not None:
        return None, reason
    if name == "cpu":
        return _build_cpu(kernel_class, specs)
    return kernel_class(), None


def _kernel_class(name: str) -> type:
    """Imported when asked for (FlashInfer's module is never imported on a CPU)."""
    if name == "cpu":
        from paged_hf.kernels.cpu_kernel import CpuKernel  # noqa: PLC0415

        return CpuKernel
    from paged_hf.kernels.flashinfer import FlashInferKernel  # noqa: PLC0415

    return FlashInferKernel


def _build_cpu(kernel_class, specs: list[AttentionSpec]) -> tuple[AttentionKernel | None, str | None]:
    from paged_hf.kernels.native import NativeBuildError  # noqa: PLC0415

    try:
        return kernel_class(specs[0].dtype, [spec.head_dim for spec in specs], specs[0].kv_dtype), None
    except NativeBuildError as error:
        logger.warning_once(f"paged_hf: the compiled CPU kernel is unavailable, using the torch kernel: {error}")
        return None, str(error)


__all__ = ["BACKENDS", "select_kernel", "select_kernels"]
