"""Linears at one to a few rows, `csrc/small_gemm.cpp`: the weights read in place (row-major, as the model has
them: no copy, no repacking), each once, at the read limit.

A decode step of one request reads every weight for one row of activations. oneDNN's matmul, which the engine
runs on packed weights for larger batches, spends most of such a call on work sized for blocks of rows: on an
Intel Xeon with AMX (`amx_bf16`, `avx512_bf16`), the default model's bf16 linears at one row ran 1.6-2.7x faster
here (q/k/v 576 -> 960: 45 -> 91 GB/s; o_proj 576 -> 576: 29 -> 80; the 1B shape's 2048 -> 16384: 50 -> 54) and
float32's 1.0-2.3x; at two rows bf16 1.1-1.9x. Past that a linear alone is faster in oneDNN's blocks, but a
decode step is more than its linears: where these loops serve every linear of a layer, the layer is one compiled
call (worker/fast_paths/native_layer.py) instead of a dozen Python calls; so on AVX-512 they serve bf16 up to 4
rows and float32 up to 8 (`max_rows`): 3-4 bf16 streams of the default model 105/130 -> 198/235 tok/s, 6-8
float32 streams 117/140 -> 193/218, the 1B shape within 2% either way (bf16 at 8 rows lost 21% there: compute
starts to count). CPUs with AVX2 only keep the per-linear limits (bf16 2, float32 4; not measured past them).
The sums are float32 in another order than oneDNN's (as oneDNN's differs from MKL's): float32 results differ in
their last bits, bf16 results round once from float32 as oneDNN's do.

Built for CPUs with AVX-512 (bf16 products native with AVX512-BF16) or with AVX2 and FMA (AMD Zen 2/3, older
Intel: 8 floats a step, bf16 widened), whichever the compiler finds (`isa`); elsewhere the engine's linears are
what they were.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from paged_hf.kernels import native
from paged_hf.profiling import span

#: rows of x up to which these loops serve a linear, by dtype: where they beat oneDNN on a linear alone (AVX2),
#: and where a layer they serve whole beats oneDNN and the layer's Python calls (AVX-512; module docstring)
MAX_ROWS = {torch.bfloat16: 2, torch.float32: 4}
MAX_ROWS_AVX512 = {torch.bfloat16: 4, torch.float32: 8}
_ENTRY = {torch.bfloat16: "small_gemm_bf16", torch.float32: "small_gemm_f32"}


@functools.lru_cache(maxsize=None)
def isa(extra_flags: tuple[str, ...] = ()) -> str:
    """"avx512_bf16", "avx512" or "avx2": what the loops compute with here; "" where they are not built (neither
    AVX-512 nor AVX2, no compiler)."""
    library = native.load_or_warn(lambda: native.load_small_gemm(extra_flags), "linears at a few rows")
    if library is None:
        return ""
    library.small_gemm_isa.restype = ctypes.c_char_p
    return library.small_gemm_isa().decode()


@functools.lru_cache(maxsize=None)
def functions(extra_flags: tuple[str, ...] = ()) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """dtype -> the typed entry point; {} where the library is not built for this CPU (`isa` is "")."""
    if not isa(extra_flags):
        return {}
    library = native.load_small_gemm(extra_flags)
    V, I = ctypes.c_void_p, ctypes.c_int64  # noqa: N806
    argtypes = [V, I, I, I, V, V, V, I, V, I, ctypes.c_int]
    return {dtype: native.entry_point(library, name, argtypes) for dtype, name in _ENTRY.items()}


def max_rows(dtype: torch.dtype, extra_flags: tuple[str, ...] = ()) -> int:
    """The most rows of `dtype` these loops serve here (0: none; bf16 on AVX-512 only with AVX512-BF16's
    products, float32 on any AVX-512)."""
    built = isa(extra_flags)
    if not built or dtype not in MAX_ROWS:
        return 0
    wide = built == "avx512_bf16" or (built == "avx512" and dtype == torch.float32)
    return (MAX_ROWS_AVX512 if wide else MAX_ROWS)[dtype]


class SmallLinear:
    """y = x [W_1; W_2; ...]^T + [b_1; b_2; ...] for x of a few rows: the weights' outputs side by side, in one
    call. Holds the weights' addresses: made again when a weight is replaced (an in-place change is read as is)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], extra_flags=()):
        self.weights, self.biases = weights, biases
        self.dtype, self.in_features = weights[0].dtype, weights[0].shape[1]
        self.out_features = sum(w.shape[0] for w in weights)
        self.max_rows = max_rows(self.dtype, extra_flags)  # the most rows `serves` takes
        self.function = functions(extra_flags).get(self.dtype)
        count = len(weights)
        self._pointers = (ctypes.c_void_p * count)(*[w.data_ptr() for w in weights])
        self._rows = (ctypes.c_int64 * count)(*[w.shape[0] for w in weights])
        self._biases = (ctypes.c_void_p * count)(*[None if b is None else b.data_ptr() for b in biases])

    def segments(self) -> tuple[int, int, int, int]:
        """(the weights' address array, their row counts, the biases' addresses, how many): what a compiled caller
        passes to this library's entry point (worker/fast_paths/native_layer.py); valid while this object lives."""
        return (ctypes.addressof(self._pointers), ctypes.addressof(self._rows), ctypes.addressof(self._biases),
                len(self.weights))

    @staticmethod
    def usable(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> bool:
        """Contiguous CPU weights of one dtype this library computes, one in_features, biases of that dtype."""
        first = weights[0]
        return (first.dtype in MAX_ROWS and bool(functions().get(first.dtype)) and all(
            w.device.type == "cpu" and w.dtype == first.dtype and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] == first.shape[1] for w in weights) and all(
            b is None or (b.dtype == first.dtype and b.is_contiguous() and b.device.type == "cpu") for b in biases))

    def serves(self, x: torch.Tensor) -> bool:
        """x [..., in_features] of this dtype, rows of unit stride, at most `max_rows` of them."""
        return (x.dtype == self.dtype and x.shape[-1] == self.in_features and x.stride(-1) == 1
                and x.numel() <= self.max_rows * self.in_features and x.numel() > 0
                and (x.dim() == 2 or x.is_contiguous()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] (`serves`) -> [..., out_features]."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=self.dtype)
        with span("matmul"):  # (a call outside torch: the profile counts it as a matmul by this range)
            status = self.function(rows.data_ptr(), rows.stride(0), rows.shape[0], self.in_features, self._pointers,
                                   self._rows, self._biases, len(self.weights), out.data_ptr(), out.stride(0),
                                   torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"small_gemm failed (status {status})")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
