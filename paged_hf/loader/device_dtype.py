"""`--device auto` and `--dtype auto`: where and in which precision the command line and `paged_hf.LLM` load a
model.

One rule, in one place, as vLLM resolves `--dtype auto`: CUDA when present; the checkpoint's own dtype (its
config.json's `dtype`/`torch_dtype`; the default model is float32). On a CPU a bfloat16 or float16 checkpoint stays
in its dtype only where the CPU computes it natively (bf16: AVX512-BF16 or AMX-BF16; fp16: AVX512-FP16 or
AMX-FP16, the flags the compiled kernels' `-march=native` builds also key on); elsewhere it runs in float32, with
a logged line, since emulated bf16 is slower than float32. A float32 checkpoint stays float32 (vLLM would cast it
down; here it keeps HF's exact outputs, and `--dtype bfloat16` is one flag away). `paged_hf.wrap(model)` never
casts: the live model keeps its dtype.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils import logging

from paged_hf.utils import cpu_flags

logger = logging.get_logger(__name__)

DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16", "float64", "half", "float", "bf16", "fp16", "fp32")
_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: the CPU flags under which a dtype is computed natively (x86: /proc/cpuinfo `flags`; Arm: `Features`)
NATIVE_CPU_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
ARM_NATIVE_CPU_FLAGS = {torch.bfloat16: ("bf16",), torch.float16: ("asimdhp",)}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in and why, in words a start-up banner can print."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_device(name: str) -> str:
    """"auto": "cuda" when a GPU is visible, else "cpu"; anything else as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def native_flags(dtype: torch.dtype, flags: frozenset[str] | None = None) -> list[str]:
    """The flags of this CPU (or of `flags`) under which it computes `dtype` natively; [] when it does not."""
    flags = cpu_flags() if flags is None else flags
    table = ARM_NATIVE_CPU_FLAGS if platform.machine().lower() in ("aarch64", "arm64") else NATIVE_CPU_FLAGS
    return [flag for flag in table.get(dtype, ()) if flag in flags]


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """AVX512-BF16 or AMX on x86, the BF16 extension on Arm (False when the flags are unknown)."""
    return bool(native_flags(torch.bfloat16, flags))


def choose_dtype(name: str, device: str, checkpoint_dtype: Callable[[], torch.dtype | None] | None = None,
                 flags: frozenset[str] | None = None) -> DtypeChoice:
    """The dtype for `--dtype name` on `device`, and why. `checkpoint_dtype()` is asked only for "auto";
    `flags`: the CPU's flags (default: this host's)."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    if name != "auto":
        dtype = getattr(torch, _ALIASES.get(name, name))
        return DtypeChoice(dtype, f"--dtype {name}")
    stored = checkpoint_dtype() if checkpoint_dtype is not None else None
    if stored is None:
        return DtypeChoice(torch.float32, "auto: the checkpoint names no dtype")
    stored_name = str(stored).removeprefix("torch.")
    if torch.device(device).type != "cpu" or stored not in NATIVE_CPU_FLAGS:
        return DtypeChoice(stored, f"auto: the checkpoint's {stored_name}")
    native = native_flags(stored, flags)
    if native:
        return DtypeChoice(stored, f"auto: the checkpoint's {stored_name}, native on this CPU ({', '.join(native)})")
    wanted = "/".join(NATIVE_CPU_FLAGS[stored])
    logger.warning("--dtype auto: the checkpoint is %s, but this CPU has no %s, so the model runs in float32 "
                   "(emulated %s is slower); --dtype %s forces it", stored_name, wanted, stored_name, stored_name)
    return DtypeChoice(torch.float32, f"auto: the checkpoint's {stored_name} is not native on this CPU (no {wanted})")


def resolve_dtype(name: str, device: str, checkpoint_dtype: Callable[[], torch.dtype | None] | None = None
                  ) -> torch.dtype:
    """The torch dtype of `choose_dtype`."""
    return choose_dtype(name, device, checkpoint_dtype).dtype


def resolve_model_dtype(name: str, device: str, model) -> DtypeChoice:
    """`choose_dtype` for the checkpoint `model` (an HF folder or hub id; None: the default model)."""
    return choose_dtype(name, device, lambda: checkpoint_dtype(model))


def checkpoint_dtype(name_or_path) -> torch.dtype | None:
    """The dtype a checkpoint's config.json names (the default model: float32). None when it names none, or when
    its config cannot be read: loading the model then says what is wrong."""
    from paged_hf.loader.default_model import is_default_model  # noqa: PLC0415

    if is_default_model(name_or_path):
        return torch.float32  # dequantized from its GGUF file
    from transformers import AutoConfig  # noqa: PLC0415

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as exc:
        logger.info("--dtype auto: cannot read %s's config (%s)", name_or_path, exc)
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = getattr(config, "dtype", None) or getattr(text, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None
