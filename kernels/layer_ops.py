"""The decoder layer's elementwise ops as single compiled calls on CPU (`csrc/layer_ops.cpp`): RMSNorm and
SiLU-and-multiply. Each function returns None where the compiled op cannot serve its arguments (another device or
dtype, rows that are not evenly strided, no compiler), and the caller then runs the model's own torch ops, which
are also what these are tested against.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from transformers.utils import logging

from paged_hf.kernels import native

logger = logging.get_logger(__name__)

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
    function[0](rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[1], weight.data_ptr(), rows.shape[0],
                rows.shape[1], eps, torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [..., 2 * inter] holding gate then up in each row, or None."""
    rows = _row_view(gate_up)
    if rows is None or rows.shape[1] % 2:
        return None
    function = _entry_points(gate_up.dtype)
    if function is None:
        return None
    inter = rows.shape[1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
    function[1](rows.data_ptr(), rows.stride(0), out.data_ptr(), inter, rows.shape[0], inter, torch.get_num_threads())
    return out


def _row_view(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with contiguous rows an even stride apart (a view, no copy), or None."""
    if x.device.type != "cpu" or x.dim() == 0 or x.stride(-1) != 1 or x.requires_grad:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # rows not evenly strided
        return None


@functools.lru_cache(maxsize=None)
def _entry_points(dtype: torch.dtype):
    """(rms_norm, silu_mul) compiled for `dtype`, or None (other dtypes; no compiler: logged once)."""
    if dtype not in NATIVE_DTYPES:
        return None
    try:
        library = native.load_layer_ops()
    except native.NativeBuildError as error:
        logger.warning(f"paged_hf: the decoder layers' elementwise ops run on torch, the compiled ones are "
                       f"unavailable: {error}")
        return None
    suffix = NATIVE_DTYPES[dtype]
    rms = getattr(library, f"rms_norm_{suffix}")
    rms.restype = ctypes.c_int
    rms.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_int]
    silu = getattr(library, f"silu_mul_{suffix}")
    silu.restype = ctypes.c_int
    silu.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                     ctypes.c_int64, ctypes.c_int]
    return rms, silu
