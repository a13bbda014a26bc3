"""Builds the compiled kernels (`csrc/paged_decode.cpp`, `csrc/paged_prefill.cpp`, `csrc/lora_sgmv.cpp`,
`csrc/layer_ops.cpp`, `csrc/quant_gemm.cpp`, `csrc/small_gemm.cpp`,
`csrc/q4_panels.cpp`) for this machine and loads them with ctypes.

Why at run time: the kernel is specialized to the model's head_dim and compiled with `-march=native`, so it
cannot ship prebuilt. A build takes ~2 s with the system C++ compiler and is cached on disk, keyed by the
source, the flags and the CPU, so it happens once per machine and head_dim. No torch headers are involved:
the library sees raw pointers, and the OpenMP runtime it links resolves to the one torch already loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging

from paged_hf.kernels.quant import KV_CACHE_DTYPES
from paged_hf.utils import cache_root, cpu_flags, cpu_model_name

logger = logging.get_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "paged_decode.cpp"
PREFILL_SOURCE = CSRC / "paged_prefill.cpp"
LORA_SOURCE = CSRC / "lora_sgmv.cpp"
LAYER_OPS_SOURCE = CSRC / "layer_ops.cpp"
QUANT_GEMM_SOURCE = CSRC / "quant_gemm.cpp"
SMALL_GEMM_SOURCE = CSRC / "small_gemm.cpp"
LEAN_LAYER_SOURCE = CSRC / "lean_layer.cpp"
Q4_PANELS_SOURCE = CSRC / "q4_panels.cpp"
#: included by the sources: part of every build's cache key
HEADERS = (CSRC / "vec_math.h", CSRC / "amx_tiles.h", CSRC / "quant_gemm_avx512.h", CSRC / "quant_gemm_bf16.h")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
#: the cache dtypes the kernel reads, by entry-point suffix; bf16/fp16 are computed in float32
DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: the dtype of the query and output each cache dtype is computed in
COMPUTE_DTYPES = {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.float32,
                  torch.float16: torch.float32}
#: quantized cache dtypes, by entry-point suffix (their kv_cache_dtype names): computed in float32, with
#: per-block scales
QUANTIZED_DTYPES = {dtype: name for name, dtype in KV_CACHE_DTYPES.items()}
#: caches (entry-point suffixes) whose decode kernel also has a `_bf16_rows` entry: a bf16 model's query and
#: output rows taken as they are, widened and rounded inside the call
BF16_ROWS_CACHES = ("bfloat16", *QUANTIZED_DTYPES.values())


class NativeBuildError(RuntimeError):
    """The compiled kernel is unavailable here (no compiler, or it failed); callers fall back to torch."""


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (the processor's name where unknown)."""
    flags = cpu_flags()
    return f"{cpu_model_name()}\n{' '.join(sorted(flags))}" if flags else platform.processor()


def _cache_dir() -> Path:
    return cache_root() / "kernels"


@functools.lru_cache(maxsize=None)
def load_paged_decode(head_dim: int) -> ctypes.CDLL:
    """The paged decode library for `head_dim`, built on first use. Raises NativeBuildError when it cannot be."""
    library = _load(SOURCE, head_dim)
    argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 5 + [ctypes.c_double, ctypes.c_int64, ctypes.c_double,
                                                                ctypes.c_int]
    for dtype_name in (*DTYPES.values(), *QUANTIZED_DTYPES.values()):
        entry_point(library, f"paged_decode_{dtype_name}", argtypes)
    for dtype_name in BF16_ROWS_CACHES:  # with q's row stride after q
        entry_point(library, f"paged_decode_{dtype_name}_bf16_rows", argtypes[:1] + [ctypes.c_int64] + argtypes[1:])
    return library


#: build flags for the prefill library: AMX's tiles emulated in plain C++ (tests on any CPU), and AMX's
#: instructions compiled in whatever the CPU (tests that the AMX build compiles and refuses to run without AMX)
EMULATE_AMX = ("-DPAGED_HF_AMX_EMULATE",)
TARGET_AMX = ("-mamx-tile", "-mamx-bf16")


@functools.lru_cache(maxsize=None)
def load_paged_prefill(head_dim: int, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The bf16 prefill attention library for `head_dim` (a multiple of 32), built on first use; None where the
    CPU lacks AVX512-BF16 (the library then only says so). Raises NativeBuildError when it cannot be built.
    Its AMX entry point exists where the CPU has AMX, or with EMULATE_AMX among `extra_flags`."""
    library = _load(PREFILL_SOURCE, head_dim, extra_flags)
    if not library.paged_prefill_available():
        return None
    argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [
        ctypes.c_double, ctypes.c_int64, ctypes.c_double, ctypes.c_int]
    entry_point(library, "paged_prefill_bfloat16", argtypes)
    if library.paged_prefill_amx_available():
        entry_point(library, "paged_prefill_amx_bfloat16", argtypes)
    return library


def prefill_isas(library: ctypes.CDLL) -> dict[str, ctypes._CFuncPtr]:
    """The prefill library's entry points by the instructions they compute with, fastest first: AMX tiles where
    the CPU has them and Linux lets this process use them, then AVX512-BF16."""
    isas = {"avx512_bf16": library.paged_prefill_bfloat16}
    if library.paged_prefill_amx_available():
        isas = {"amx_bf16": library.paged_prefill_amx_bfloat16, **isas}
    return isas


@functools.lru_cache(maxsize=None)
def load_lora() -> ctypes.CDLL:
    """The multi-LoRA (SGMV) library, built on first use; its entry points are typed by `kernels.lora`. Raises
    NativeBuildError when it cannot be built."""
    return _load(LORA_SOURCE, None)


@functools.lru_cache(maxsize=None)
def load_layer_ops() -> ctypes.CDLL:
    """The decoder layer's fused elementwise ops (RMSNorm, SiLU-and-multiply), built on first use; typed by
    `kernels.layer_ops`. Raises NativeBuildError when it cannot be built."""
    return _load(LAYER_OPS_SOURCE, None)


@functools.lru_cache(maxsize=None)
def load_quant_gemm(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The quantized linears (int8 and int4 weights), built on first use; typed by `kernels.quant_gemm`.
    `extra_flags`: e.g. ("-mno-avx2",) builds the portable loops on an AVX2 machine (tests). Raises
    NativeBuildError when it cannot be built."""
    return _load(QUANT_GEMM_SOURCE, None, extra_flags)


@functools.lru_cache(maxsize=None)
def load_small_gemm(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The linears at a few rows (float32 and bf16 weights as the model has them), built on first use; typed by
    `kernels.small_gemm`. `extra_flags`: e.g. ("-mno-avx512bf16",) builds the loop for CPUs without AVX512-BF16
    (tests). Raises NativeBuildError when it cannot be built."""
    return _load(SMALL_GEMM_SOURCE, None, extra_flags)


@functools.lru_cache(maxsize=None)
def load_q4_panels(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """W4A8 on 4-bit weights repacked in panels of 16 channels, built on first use; typed by `kernels.q4_panels`.
    `extra_flags`: ("-mno-avx512f",) builds the AVX2 loops, ("-mno-avx2", "-mno-fma") the portable ones (tests).
    Raises NativeBuildError when it cannot be built."""
    return _load(Q4_PANELS_SOURCE, None, extra_flags)


@functools.lru_cache(maxsize=None)
def load_lean_layer() -> ctypes.CDLL:
    """A lean decoder layer as one call of the other libraries' entry points (worker/fast_paths/native_layer.py),
    built on first use. Raises NativeBuildError when it cannot be built."""
    return _load(LEAN_LAYER_SOURCE, None)


def _load(source: Path, head_dim: int | None, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """`source` built for `head_dim` (None: a kernel without one; cached by source, headers, compiler, flags and
    CPU) and loaded."""
    compiler = _compiler()
    flags = (*COMPILE_FLAGS, *extra_flags, *(() if head_dim is None else (f"-DPAGED_HF_HEAD_DIM={head_dim}",)))
    texts = [source.read_text(), *(header.read_text() for header in HEADERS)]
    key = hashlib.sha256(
        "\0".join([*texts, compiler, *flags, _cpu_signature(), platform.machine()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}{'' if head_dim is None else f'_d{head_dim}'}_{key}.so"
    try:
        if not target.exists():
            _build(compiler, flags, source, target)
            logger.info(f"paged_hf: built the native kernel {source.name} ({target})")
        return ctypes.CDLL(str(target))
    except OSError as error:  # an unwritable cache, a compiler that cannot start, a library that cannot load
        raise NativeBuildError(f"cannot build or load {target}: {error}") from error


def _build(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # build aside, rename into place: atomic
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, str(source), "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeBuildError(f"{compiler} failed to build {source.name}:\n{result.stderr[-2000:]}")
        os.replace(built, target)


def entry_point(library: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    """`library.name` typed: `argtypes` in, an int status out (0: done)."""
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = argtypes
    return function


def load_or_warn(load, what: str) -> ctypes.CDLL | None:
    """`load()`'s library, or None with a warning that `what` runs on torch ops instead (no compiler, a failed
    build); callers cache the answer, so it is said once."""
    try:
        return load()
    except NativeBuildError as error:
        logger.warning(f"paged_hf: {what} runs on torch ops, the compiled kernel is unavailable: {error}")
        return None


def head_dim_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """The kernel computes in 64-byte vectors of the compute dtype: head_dim must be a whole number of them."""
    return dtype in DTYPES and head_dim % (64 // COMPUTE_DTYPES[dtype].itemsize) == 0


def prefill_head_dim_fits(head_dim: int) -> bool:
    """The bf16 prefill kernel packs values 32 dimensions at a time."""
    return head_dim % 32 == 0
