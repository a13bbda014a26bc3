"""`--device auto` and `--dtype auto`: where and in which precision the command line loads a model.

One rule, in one place: CUDA when present; on a GPU the checkpoint's own dtype; on a CPU float32 (bfloat16 only
if `CPU_BF16_FAST_PATH` is switched on and the CPU computes it natively).
"""

from __future__ import annotations

import platform

import torch

#: Whether `--dtype auto` picks bfloat16 on a CPU that computes it natively. Off: on CPU the default stays float32,
#: whose outputs match HF's token for token; bf16 is opt-in (`--dtype bfloat16`: 1.8x float32's tok/s on the
#: mixed workload with AVX512-BF16, docs/benchmarks.md), as it changes the numbers a user compares with HF.
CPU_BF16_FAST_PATH = False

DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16", "float64", "half", "float", "bf16", "fp16", "fp32")
_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def resolve_device(name: str) -> str:
    """"auto": "cuda" when a GPU is visible, else "cpu"; anything else as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX on x86, the BF16 extension on Arm (read from /proc/cpuinfo; False when unknown)."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = set(fh.read().lower().split())
    except OSError:
        return False
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(name: str, device: str, checkpoint_dtype=None) -> torch.dtype:
    """The torch dtype for `--dtype name` on `device`; `checkpoint_dtype()` is asked only on a GPU."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    if name != "auto":
        return getattr(torch, _ALIASES.get(name, name))
    if torch.device(device).type != "cpu":
        return (checkpoint_dtype() if checkpoint_dtype is not None else None) or torch.float32
    return torch.bfloat16 if CPU_BF16_FAST_PATH and cpu_has_native_bf16() else torch.float32


def checkpoint_dtype(name_or_path) -> torch.dtype | None:
    """The dtype a checkpoint's config.json names (None when it names none); the default model is float32."""
    from paged_hf.loader.default_model import is_default_model  # noqa: PLC0415

    if is_default_model(name_or_path):
        return torch.float32  # dequantized from its GGUF file
    from transformers import AutoConfig  # noqa: PLC0415

    dtype = getattr(AutoConfig.from_pretrained(name_or_path), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None
