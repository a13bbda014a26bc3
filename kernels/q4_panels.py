"""W4A8: 4-bit weights repacked once at load into panels of 16 output channels (`csrc/q4_panels.cpp`), and the
activations quantized per block of 32 to int8 at run time, as llama.cpp computes Q4_0 x Q8_0 on its repacked
Q4_0: the weights' integers times the activations' in exact int32 sums (AVX512-VNNI's vpdpbusd; AVX2's vpmaddubsw
where the CPU has no AVX-512), each weight byte read once in memory order, one 64-byte load serving 16 channels.

The weights are those of `quantization="w4a16"` (4-bit groups of 64 with zero points, `w = (u - z) * s`), their
scales rounded to float16 (`half_groups`: as Q4_0's and GPTQ's are; in float32, scale and zero point were a fifth of
the bytes a token reads); the activations differ: w4a16 multiplies them as they are, W4A8 rounds each to one of 255
levels of its block's largest magnitude first (`quantize_blocks`). That is a different computation, so it is its own
mode (`quantization="w4a8"`), tested against its own torch reference (`reference`), never a silent stand-in for
w4a16.

Layouts (`repack` and its inverse `unrepack`): panels [n / 16, k / 32 * 256] uint8: per panel and block of 32 k,
4 x 64 bytes (t = 0..3), channel r's 4 bytes at 4 r, byte i: u[32 b + 8 t + i] | u[32 b + 8 t + 4 + i] << 4;
scales and zeros [n / 16, groups * 16] float16 (a panel's 16 channels side by side, group by group).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from paged_hf.kernels import native
from paged_hf.kernels.quant_gemm import CompiledLayerLinear
from paged_hf.profiling import span

PANEL = 16  # output channels per panel
BLOCK = 32  # k per activation block


@functools.lru_cache(maxsize=None)
def library(extra_flags: tuple[str, ...] = ()):
    """The typed library, or None (no compiler; logged once)."""
    lib = native.load_or_warn(lambda: native.load_q4_panels(extra_flags), "W4A8 linears")
    if lib is None:
        return None
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    native.entry_point(lib, "q4_panels_linear", [p, i64, c_int, i64, i64, p, p, p, i64, p, i64, p, i64, p, p, p,
                                                 c_int])
    lib.q4_panels_isa.restype = ctypes.c_char_p
    return lib


def isa(extra_flags: tuple[str, ...] = ()) -> str | None:
    """"avx512_vnni", "avx2" or "generic": what the build computes with; None without a build."""
    lib = library(extra_flags)
    return None if lib is None else lib.q4_panels_isa().decode()


def fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether a linear of these sizes can be repacked: whole panels, whole blocks, groups of whole blocks."""
    return out_features % PANEL == 0 and in_features % BLOCK == 0 and group_size % BLOCK == 0 \
        and in_features % group_size == 0


def repack(values: torch.Tensor) -> torch.Tensor:
    """values [n, k] in [0, 15] -> panels [n / 16, k / 32 * 256] uint8 (the layout above)."""
    n, k = values.shape
    v = values.to(torch.uint8).view(n // PANEL, PANEL, k // BLOCK, 4, 2, 4)  # [panel, r, b, t, half, i]
    v = v.permute(0, 2, 3, 1, 5, 4)  # [panel, b, t, r, i, half]
    return (v[..., 0] | (v[..., 1] << 4)).reshape(n // PANEL, -1).contiguous()


def unrepack(panels: torch.Tensor, k: int) -> torch.Tensor:
    """repack's inverse: [n, k] uint8 values."""
    p = panels.view(panels.shape[0], k // BLOCK, 4, PANEL, 4)  # [panel, b, t, r, i]
    both = torch.stack([p & 15, p >> 4], -1)  # [panel, b, t, r, i, half]
    return both.permute(0, 3, 1, 2, 5, 4).reshape(panels.shape[0] * PANEL, k)


def half_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zero points [n, groups] -> [n / 16, groups * 16] float16, the kernel's layout (zero points
    are integers: exact)."""
    return repack_groups(t.to(torch.float16))


def repack_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-group values [n, groups] -> [n / 16, groups * 16] (a panel's channels side by side)."""
    n, groups = t.shape
    return t.view(n // PANEL, PANEL, groups).transpose(1, 2).reshape(n // PANEL, groups * PANEL).contiguous()


def unrepack_groups(t: torch.Tensor) -> torch.Tensor:
    """repack_groups' inverse: [n, groups]."""
    panels, width = t.shape
    return t.view(panels, width // PANEL, PANEL).transpose(1, 2).reshape(panels * PANEL, width // PANEL)


def quantize_blocks(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x32 [m, k] float32 -> (q [m, k / 32, 32] float32 holding integers in [-127, 127], s_x [m, k / 32]): per
    block symmetric int8, as the kernel computes it (one rounded division 127 / amax, round half to even)."""
    m, k = x32.shape
    blocks = x32.view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv[..., None]).clamp(-127, 127), amax / 127.0


def reference(x32: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """float32 [m, n] of x32 [m, k]: values [n, k] integers, scales and zeros [n, groups] (not repacked; as the
    kernel reads them: float16 values).
    Per block b: t = float(sum q u) - z * float(sum q), y = sum over b of (s_x * s) * t (the kernel sums in k
    order with FMAs: equal up to the order and rounding of that float sum)."""
    q, sx = quantize_blocks(x32)  # [m, blocks, 32], [m, blocks]
    blocks = q.shape[1]
    u = values.float().view(values.shape[0], blocks, BLOCK)  # [n, blocks, 32]
    # exact in float32 in any order: every partial sum is an integer below 32 * 127 * 15 < 2^24
    dots = torch.bmm(q.transpose(0, 1), u.permute(1, 2, 0)).transpose(0, 1)  # [m, blocks, n]
    sums = q.sum(-1)  # [m, blocks], exact
    per_group = group_size // BLOCK
    s_b, z_b = (t.float().repeat_interleave(per_group, 1).T for t in (scales, zeros))  # [blocks, n]
    t = dots - z_b[None] * sums[..., None]  # [m, blocks, n]
    return ((sx[..., None] * s_b[None]) * t).sum(1)


def linear(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
           bias: torch.Tensor | None, extra_flags: tuple[str, ...] = ()) -> torch.Tensor | None:
    """[m, n] in x's dtype (bf16 or float32; others None) of x [..., k]: panels, scales, zeros repacked (above;
    `half_groups`), bias [n] in x's dtype or None. None where the library is not built or x is not on the CPU."""
    if scales.dtype != torch.float16 or zeros.dtype != torch.float16:
        raise ValueError(f"W4A8's scales and zeros are float16 (half_groups), got {scales.dtype}, {zeros.dtype}")
    lib = library(extra_flags)
    if lib is None or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or x.requires_grad:
        return None
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m, k = rows.shape
    n = panels.shape[0] * PANEL
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    out = torch.empty(m, n, dtype=x.dtype)
    q = torch.empty(m, k, dtype=torch.int8)
    sx, sq = torch.empty(m, k // BLOCK, dtype=torch.float32), torch.empty(m, k // BLOCK, dtype=torch.float32)
    with span("matmul"):
        status = lib.q4_panels_linear(rows.data_ptr(), rows.stride(0), int(x.dtype == torch.bfloat16), m, k,
                                      panels.data_ptr(), scales.data_ptr(), zeros.data_ptr(), group_size,
                                      None if bias is None else bias.data_ptr(), n, out.data_ptr(), n, q.data_ptr(),
                                      sx.data_ptr(), sq.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


class _Struct(ctypes.Structure):  # csrc/q4_panels.cpp's Q4PanelLinear
    _fields_ = [("panels", ctypes.c_void_p), ("s", ctypes.c_void_p), ("z", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("k", ctypes.c_int64), ("group", ctypes.c_int64), ("n", ctypes.c_int64)]


#: rows up to which the compiled decode layer calls the panels (the few-row loops' entry point)
MAX_ROWS = 8


class PanelLinear(CompiledLayerLinear):
    """A W4A8 linear (`Int4Linear` with `panels`) as the compiled decode layer calls it: the panels' entry point
    of the few-row loops' signature for the model's dtype."""

    max_rows = MAX_ROWS

    def __init__(self, linear, modes_of):
        self.bias = None if linear.bias is None else linear.bias.contiguous()  # kept: the struct holds its address
        struct = _Struct(linear.qweight.data_ptr(), linear.scales.data_ptr(), linear.zeros.data_ptr(),
                         None if self.bias is None else self.bias.data_ptr(), linear.in_features, linear.group_size,
                         linear.out_features)
        lib = library()
        name = "q4_panels_gemm_bf16" if linear.dtype == torch.bfloat16 else "q4_panels_gemm_f32"
        super().__init__(linear, modes_of, struct,
                         None if lib is None else ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)

    @classmethod
    def of(cls, linear, modes_of=None) -> PanelLinear | None:
        """The linear's PanelLinear, or None where it has no panels."""
        if not getattr(linear, "panels", False) or linear.dtype not in (torch.bfloat16, torch.float32) \
                or linear.qweight.device.type != "cpu" or library() is None:
            return None
        modes_of = modes_of or linear
        return cls.kept(linear, modes_of, (linear.qweight, linear.scales, linear.zeros, linear.bias, modes_of))

    def serves(self, x: torch.Tensor) -> bool:
        """x of the model's dtype, at most MAX_ROWS rows, W4A8 switched on (the engine probe switches it off)."""
        return self.gemm is not None and self.modes_of.act_quant and super().serves(x)
