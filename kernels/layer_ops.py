"""The decoder layer's elementwise ops as single compiled calls on CPU (`csrc/layer_ops.cpp`): RMSNorm,
SiLU-and-multiply and rotary embeddings. Each function returns None (False) where the compiled op cannot serve its
arguments (another device or dtype, rows that are not evenly strided, no compiler), and the caller then runs the
model's own torch ops, which are also what these are tested against.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from paged_hf.kernels import native
from paged_hf.profiling import span

#: dtypes the compiled ops compute (bf16 in float32), by entry-point suffix
NATIVE_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """HF's RMSNorm of x [..., hidden] (`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`), or None."""
    rows = _row_view(x)
    if rows is None or weight.dtype != x.dtype or not weight.is_contiguous() or weight.device.type != "cpu":
        return None
    function = _entry_points(x.dtype)
    if function is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    with span("elementwise"):
        function[0](rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[1], weight.data_ptr(), rows.shape[0],
                    rows.shape[1], eps, torch.get_num_threads())
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up, both [..., inter] (rows read in place: e.g. the halves of a fused gate/up output), or None."""
    gate_rows, up_rows = _row_view(gate), _row_view(up)
    if gate_rows is None or up_rows is None or gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    function = _entry_points(gate.dtype)
    if function is None:
        return None
    inter = gate_rows.shape[1]
    out = torch.empty(gate.shape, dtype=gate.dtype)
    with span("elementwise"):
        function[1](gate_rows.data_ptr(), gate_rows.stride(0), up_rows.data_ptr(), up_rows.stride(0), out.data_ptr(),
                    inter, gate_rows.shape[0], inter, torch.get_num_threads())
    return out


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> bool:
    """HF's rotary embedding (`x * cos + rotate_half(x) * sin`) applied in place to the first `heads` heads of each
    row of x [..., >= heads * head_dim] (the q and k heads of a fused q/k/v output), with cos/sin [..., head_dim]
    one row per row of x; False (x untouched) where the compiled op cannot serve them."""
    rows, cos_rows, sin_rows = _row_view(x), _row_view(cos), _row_view(sin)
    if (rows is None or cos_rows is None or sin_rows is None or head_dim % 2 or cos.dtype != x.dtype
            or sin.dtype != x.dtype or cos_rows.shape != (rows.shape[0], head_dim) or sin_rows.shape != cos_rows.shape
            or sin_rows.stride(0) != cos_rows.stride(0) or rows.shape[1] < heads * head_dim):
        return False
    function = _entry_points(x.dtype)
    if function is None:
        return False
    with span("elementwise"):
        function[2](rows.data_ptr(), rows.stride(0), cos_rows.data_ptr(), sin_rows.data_ptr(), cos_rows.stride(0),
                    rows.shape[0], heads, head_dim, torch.get_num_threads())
    return True


def _row_view(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with contiguous rows an even stride apart (a view, no copy), or None. Checked on the
    strides, not by trying `view`: a refused view raises, and this runs per layer."""
    if x.device.type != "cpu" or x.dim() == 0 or x.stride(-1) != 1 or x.requires_grad:
        return None
    row_stride, expected = x.shape[-1], None
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if expected is None:
            row_stride = stride
        elif stride != expected:
            return None
        expected = stride * size
    return x.as_strided((x.numel() // max(x.shape[-1], 1), x.shape[-1]), (row_stride, 1))


@functools.lru_cache(maxsize=None)
def _entry_points(dtype: torch.dtype):
    """(rms_norm, silu_mul, rotary) compiled for `dtype`, or None (other dtypes; no compiler: logged once)."""
    if dtype not in NATIVE_DTYPES:
        return None
    library = native.load_or_warn(native.load_layer_ops, "the decoder layers' elementwise code")
    if library is None:
        return None
    suffix, pointer, size = NATIVE_DTYPES[dtype], ctypes.c_void_p, ctypes.c_int64
    rms = native.entry_point(library, f"rms_norm_{suffix}", [pointer, size, pointer, size, pointer, size, size,
                                                            ctypes.c_double, ctypes.c_int])
    silu = native.entry_point(library, f"silu_mul_{suffix}", [pointer, size, pointer, size, pointer, size, size,
                                                             size, ctypes.c_int])
    rotary = native.entry_point(library, f"rotary_{suffix}", [pointer, size, pointer, pointer, size, size, size,
                                                             size, ctypes.c_int])
    return rms, silu, rotary
