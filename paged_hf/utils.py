"""Small helpers every layer uses: checks of user input that name the field, ceiling division, percentiles, the
cache folder, the host's CPU (model name and flags) that the dtype rule and the benchmarks name."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import math
import os
from pathlib import Path

#: the environment variable that moves paged_hf's cache folder (converted default model, compiled kernels)
CACHE_ENV_VAR = "PAGED_HF_CACHE"


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that `a` tokens fill at `b` per block."""
    return -(-a // b)


def is_int(value) -> bool:
    """An int that is not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def field_checker(owner: str):
    """-> check(ok, name, value, expected): a ValueError that names the field when `ok` is false,
    "{owner}.{name} must be {expected}, got {value!r}"."""

    def check(ok: bool, name: str, value, expected: str) -> None:
        if not ok:
            raise ValueError(f"{owner}.{name} must be {expected}, got {value!r}")

    return check


def config_fields(value, name: str, known: set[str]) -> dict:
    """A config given as a dict or JSON object text (the CLI's form) -> its fields; ValueError naming `name` for
    bad JSON, a non-object or a field not in `known`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (JSON object), got {value!r}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {name} field(s) {unknown}; known: {sorted(known)}")
    return value


def percentile(values, q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of the values that are not None; None if there are none."""
    values = sorted(v for v in (values or []) if v is not None)
    if not values:
        return None
    position = (len(values) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return values[low] + (values[high] - values[low]) * (position - low)


def cache_root() -> Path:
    """paged_hf's cache folder: ``$PAGED_HF_CACHE``, else ``$XDG_CACHE_HOME/paged_hf`` or ``~/.cache/paged_hf``."""
    root = os.environ.get(CACHE_ENV_VAR)
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "paged_hf"


# --- the host: which CPU (and GPU) a figure was measured on, and what the CPU computes natively --------------

#: the CPU flags that decide low-precision speed: bf16 / fp16 computed natively (AMX tiles, AVX-512 dot products)
LOW_PRECISION_FLAGS = ("amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16")


def _cpuinfo_fields(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo ({} where there is none: macOS, Windows)."""
    fields: dict[str, str] = {}
    try:
        with open(path) as fh:
            for line in fh:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, lower case (`avx512_bf16`, `amx_bf16`, ...; Arm's `features`): empty when unknown."""
    fields = _cpuinfo_fields()
    return frozenset((fields.get("flags") or fields.get("features") or "").lower().split())


def cpu_model_name() -> str:
    """The CPU's model as the OS names it ("AMD EPYC 9B45", "Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz")."""
    import platform  # noqa: PLC0415 - only here

    name = _cpuinfo_fields().get("model name")
    if not name:
        import shutil  # noqa: PLC0415 - only here
        import subprocess  # noqa: PLC0415 - only here

        if shutil.which("lscpu"):
            lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
            name = next((line.split(":", 1)[1].strip() for line in lines.splitlines()
                         if line.lower().startswith("model name")), "")
    return " ".join((name or platform.processor() or platform.machine() or "unknown CPU").split())


def describe_host(flags: frozenset[str] | None = None) -> str:
    """One line naming where a figure was measured: the CPU model, its low-precision flags (or that it has none),
    and the GPU when CUDA is there: "AMD EPYC 9B45 (avx512_bf16; no AMX)"."""
    flags = cpu_flags() if flags is None else flags
    native = [flag for flag in LOW_PRECISION_FLAGS if flag in flags]
    isa = ", ".join(native) if native else "no AVX512-BF16/FP16"
    if native and not any(flag.startswith("amx") for flag in native):
        isa += "; no AMX"
    line = f"{cpu_model_name()} ({isa})"
    try:
        import torch  # noqa: PLC0415 - utils imports nothing heavy at import time

        if torch.cuda.is_available():
            line += f", GPU {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return line


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)


def trim_heap() -> None:
    """glibc's malloc_trim(0) over every arena (ctypes lets the GIL go meanwhile); elsewhere nothing. glibc keeps
    what is freed for reuse: a model quantized at load left its float weights' pages resident (int8 default model:
    3.4x the int8 weights' bytes after loading, 1.5x after a trim; measured)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
