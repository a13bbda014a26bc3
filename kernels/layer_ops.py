"""The decoder layer's elementwise ops as single compiled calls on CPU (`csrc/layer_ops.cpp`): RMSNorm (alone
or after the residual add), SiLU-and-multiply and rotary embeddings; and the greedy sampler's row argmax. Each
function returns None (False) where the compiled op cannot serve its arguments (another device or dtype, rows
that are not evenly strided, no compiler), and the caller then runs the model's own torch ops, which are also
what these are tested against. `RowOps`: the same compiled ops, and rotary with the K/V writes in one call, for
a caller that checked its tensors once a step (worker/fast_paths/lean_layers.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import NamedTuple

import torch

from paged_hf.kernels import native
from paged_hf.profiling import span

#: dtypes the compiled ops compute (bf16 in float32), by entry-point suffix
NATIVE_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}


class Rows(NamedTuple):
    """A tensor as [count, cols] rows of contiguous elements, `stride` elements apart, from `pointer`."""
    pointer: int
    stride: int
    count: int
    cols: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """HF's RMSNorm of x [..., hidden] (`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`), or None."""
    rows = _rows(x)
    if rows is None or weight.dtype != x.dtype or not weight.is_contiguous() or weight.device.type != "cpu":
        return None
    function = _entry_points(x.dtype)
    if function is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    with span("elementwise"):
        function[0](rows.pointer, rows.stride, out.data_ptr(), rows.cols, weight.data_ptr(), rows.count, rows.cols,
                    eps, torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + h, HF's RMSNorm of it): a decoder layer's residual add and the norm after it in one pass, or None."""
    x_rows, h_rows = _rows(x), _rows(h)
    if (x_rows is None or h_rows is None or x.shape != h.shape or h.dtype != x.dtype or weight.dtype != x.dtype
            or not weight.is_contiguous() or weight.device.type != "cpu"):
        return None
    function = _entry_points(x.dtype)
    if function is None:
        return None
    total, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    with span("elementwise"):
        function[4](x_rows.pointer, x_rows.stride, h_rows.pointer, h_rows.stride, total.data_ptr(), out.data_ptr(),
                    weight.data_ptr(), x_rows.count, x_rows.cols, eps, torch.get_num_threads())
    return total, out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up, both [..., inter] (rows read in place: e.g. the halves of a fused gate/up output), or None."""
    gate_rows, up_rows = _rows(gate), _rows(up)
    if gate_rows is None or up_rows is None or gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    function = _entry_points(gate.dtype)
    if function is None:
        return None
    inter = gate_rows.cols
    out = torch.empty(gate.shape, dtype=gate.dtype)
    with span("elementwise"):
        function[1](gate_rows.pointer, gate_rows.stride, up_rows.pointer, up_rows.stride, out.data_ptr(), inter,
                    gate_rows.count, inter, torch.get_num_threads())
    return out


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> bool:
    """HF's rotary embedding (`x * cos + rotate_half(x) * sin`) applied in place to the first `heads` heads of each
    row of x [..., >= heads * head_dim] (the q and k heads of a fused q/k/v output), with cos/sin [..., head_dim]
    one row per row of x; False (x untouched) where the compiled op cannot serve them."""
    rows, cos_rows, sin_rows = _rows(x), _rows(cos), _rows(sin)
    if (rows is None or cos_rows is None or sin_rows is None or head_dim % 2 or cos.dtype != x.dtype
            or sin.dtype != x.dtype or (cos_rows.count, cos_rows.cols) != (rows.count, head_dim)
            or (sin_rows.count, sin_rows.cols) != (cos_rows.count, cos_rows.cols) or sin_rows.stride != cos_rows.stride
            or rows.cols < heads * head_dim):
        return False
    function = _entry_points(x.dtype)
    if function is None:
        return False
    with span("elementwise"):
        function[2](rows.pointer, rows.stride, cos_rows.pointer, sin_rows.pointer, cos_rows.stride, rows.count, heads,
                    head_dim, torch.get_num_threads())
    return True


def argmax_rows(x: torch.Tensor) -> list[int] | None:
    """The first index of each row's maximum of x [rows, cols], a NaN counting as the maximum: what
    `x.max(dim=-1).indices` gives (the greedy sampler's tokens), or None. One pass at memory speed: torch's bf16
    max reduction runs ~4x slower."""
    rows = _rows(x)
    if rows is None or x.dim() != 2:
        return None
    function = _entry_points(x.dtype)
    if function is None:
        return None
    out = torch.empty(rows.count, dtype=torch.int64)
    function[3](rows.pointer, rows.stride, out.data_ptr(), rows.count, rows.cols, torch.get_num_threads())
    return out.tolist()


def scale_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """float32 [rows, cols] of x [..., cols] times `scale` [cols] (float32), rounded to x's dtype on the way as
    `(x.float() * scale).to(x.dtype).float()` rounds it (a quantized linear's smoothed input), or None."""
    rows = _rows(x)
    if (rows is None or scale.dtype != torch.float32 or not scale.is_contiguous() or scale.device.type != "cpu"
            or scale.numel() != rows.cols):
        return None
    function = _entry_points(x.dtype)
    if function is None:
        return None
    out = torch.empty(rows.count, rows.cols, dtype=torch.float32)
    with span("elementwise"):
        function[5](rows.pointer, rows.stride, scale.data_ptr(), out.data_ptr(), rows.count, rows.cols,
                    torch.get_num_threads())
    return out


def scatter_rows(source: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """cache.view(-1, *source.shape[1:]).index_copy_(0, slots, source) for source [tokens, ...] whose tokens are
    contiguous rows (a token's K or V heads) into a contiguous CPU cache of the same dtype: one call instead of a
    view and an index_copy_ per tensor. False (nothing written) where it cannot serve them."""
    if (source.dim() < 2 or source.device.type != "cpu" or not _heads_contiguous(source)
            or cache.dtype != source.dtype or not cache.is_contiguous() or cache.device.type != "cpu"
            or slots.dtype != torch.int64 or not slots.is_contiguous() or slots.device.type != "cpu"
            or slots.numel() != source.shape[0]):
        return False
    cols = math.prod(source.shape[1:])
    if cols == 0 or cache.numel() % cols:
        return False
    function = _scatter()
    if function is None:
        return False
    size = source.element_size()
    function(source.data_ptr(), source.stride(0) * size, cache.data_ptr(), cols * size, slots.data_ptr(),
             source.shape[0])
    return True


class RowOps:
    """The compiled ops for a caller that checked its tensors once (the lean decoder layers of a step,
    worker/fast_paths/lean_layers.py): every tensor here is a contiguous CPU tensor of `dtype` (bfloat16 or
    float32), rows of its last dim, outputs included (the caller's buffers), and nothing is checked again. The
    same entry points, so the same bits, as the checked functions above; without their checks, which cost more
    Python than a small step's kernels take (~10-25 us a call)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.rms, self.silu, _, _, self.add_rms, _, self.rotary_write = _entry_points(dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        cols = x.shape[-1]
        with span("elementwise"):
            self.rms(x.data_ptr(), cols, out.data_ptr(), cols, weight.data_ptr(), x.numel() // cols, cols, eps,
                     torch.get_num_threads())

    def add_rms_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, total: torch.Tensor,
                     out: torch.Tensor) -> None:
        cols = x.shape[-1]
        with span("elementwise"):
            self.add_rms(x.data_ptr(), cols, h.data_ptr(), cols, total.data_ptr(), out.data_ptr(), weight.data_ptr(),
                         x.numel() // cols, cols, eps, torch.get_num_threads())

    def silu_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """silu(gate) * up of gate_up = [..., gate | up] (a fused gate/up output) into out [..., inter]."""
        cols = gate_up.shape[-1]
        inter, pointer = cols // 2, gate_up.data_ptr()
        with span("elementwise"):
            self.silu(pointer, cols, pointer + inter * gate_up.element_size(), cols, out.data_ptr(), inter,
                      gate_up.numel() // cols, inter, torch.get_num_threads())

    def rotate_and_write(self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                         key_start: int, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slots: torch.Tensor) -> None:
        """`rotate_in_place` of the first `heads` heads of rows [tokens, cols] (cos/sin [..., head_dim], one row
        per token), then columns [key_start, + a cache row) and the cache row after them to row slots[i] of the
        key and value caches ([..., kv_heads, head_dim]), as `scatter_rows` writes them."""
        head_dim = cos.shape[-1]
        with span("elementwise"):
            self.rotary_write(rows.data_ptr(), rows.shape[-1], cos.data_ptr(), sin.data_ptr(), head_dim, rows.shape[0],
                              heads, head_dim, key_start, key_cache.shape[-1] * key_cache.shape[-2],
                              key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def row_ops(dtype: torch.dtype) -> RowOps | None:
    """RowOps for a bfloat16 or float32 model, or None (other dtypes; no compiler)."""
    if dtype not in (torch.bfloat16, torch.float32) or _entry_points(dtype) is None:
        return None
    return RowOps(dtype)


def _heads_contiguous(x: torch.Tensor) -> bool:
    """Every dim after the first laid out contiguously (a token's heads one after the other)."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=None)
def _scatter():
    """scatter_rows, or None (no compiler: logged once)."""
    library = native.load_or_warn(native.load_layer_ops, "the decoder layers' elementwise code")
    if library is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    return native.entry_point(library, "scatter_rows", [pointer, size, pointer, size, pointer, size])


def _rows(x: torch.Tensor) -> Rows | None:
    """x as rows of contiguous elements an even stride apart (read in place), or None. Plain numbers, not a
    view: checked on the strides, and this runs several times per layer (a contiguous x, the common case, in
    three attribute reads)."""
    if not x.is_cpu or x.dim() == 0 or x.requires_grad:
        return None
    cols = x.shape[-1]
    if x.is_contiguous():
        return Rows(x.data_ptr(), cols, x.numel() // max(cols, 1), cols)
    strides = x.stride()
    if strides[-1] != 1:
        return None
    row_stride, expected = cols, None
    for size, stride in zip(reversed(x.shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if expected is None:
            row_stride = stride
        elif stride != expected:
            return None
        expected = stride * size
    return Rows(x.data_ptr(), row_stride, x.numel() // max(cols, 1), cols)


@functools.lru_cache(maxsize=None)
def _entry_points(dtype: torch.dtype):
    """(rms_norm, silu_mul, rotary, argmax_rows, add_rms_norm, scale_rows, rotary_write) compiled for `dtype`, or
    None (other dtypes; no compiler: logged once)."""
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
    argmax = native.entry_point(library, f"argmax_rows_{suffix}", [pointer, size, pointer, size, size, ctypes.c_int])
    add_rms = native.entry_point(library, f"add_rms_norm_{suffix}", [pointer, size, pointer, size, pointer, pointer,
                                                                    pointer, size, size, ctypes.c_double, ctypes.c_int])
    scale = native.entry_point(library, f"scale_rows_{suffix}", [pointer, size, pointer, pointer, size, size,
                                                                ctypes.c_int])
    rotary_write = native.entry_point(library, f"rotary_write_{suffix}", [pointer, size, pointer, pointer, size, size,
                                                                         size, size, size, size, pointer, pointer,
                                                                         pointer, ctypes.c_int])
    return rms, silu, rotary, argmax, add_rms, scale, rotary_write
