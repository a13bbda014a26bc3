"""The compiled quantized linears (`csrc/quant_gemm.cpp`) on torch tensors: W8A8, W8A16 and W4A16 on float32
activations. Each function returns None where the compiled code cannot serve its arguments (another device, a
shape it does not take, no compiler); the caller then runs the torch reference (`kernels.quant_linear`), which is
also what these are tested against.

The library is built for this machine's CPU (`-march=native`): AVX-512 where the CPU has AVX512F/BW (W8A8 from 3
rows on AVX512-VNNI's vpdpbusd; W8A16/W4A16 for any rows), AVX2 with FMA for the rest, else plain loops; `isa()`
says which. `extra_flags` builds another variant on the same machine (tests: the AVX2 loops alone with
`-mno-avx512f`, the portable loops with `-mno-avx2`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from paged_hf.kernels import native
from paged_hf.profiling import span

#: the flags that build the portable loops on an x86 machine with AVX2 (tests compare the builds)
PORTABLE_FLAGS = ("-mno-avx2", "-mno-fma")
#: the flags that build the AVX2 loops alone on an AVX-512 machine
AVX2_FLAGS = ("-mno-avx512f",)


@functools.lru_cache(maxsize=None)
def library(extra_flags: tuple[str, ...] = ()):
    """The typed library, or None (no compiler; logged once)."""
    lib = native.load_or_warn(lambda: native.load_quant_gemm(extra_flags), "quantized linears")
    if lib is None:
        return None
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    native.entry_point(lib, "w8a8_linear", [p, i64, i64, i64, p, p, p, i64, i64, p, i64, p, p, c_int])
    native.entry_point(lib, "w8a8_linear_bf16", [p, i64, i64, i64, p, p, p, p, i64, i64, p, i64, p, p, p, c_int])
    native.entry_point(lib, "quantize_rows", [p, i64, i64, i64, i64, p, p])
    native.entry_point(lib, "w8a16_linear", [p, i64, i64, i64, p, p, p, i64, i64, p, i64, c_int])
    native.entry_point(lib, "w4a16_linear", [p, i64, i64, i64, p, p, p, i64, p, i64, p, i64, c_int])
    native.entry_point(lib, "w4a16_linear_bf16", [p, i64, i64, i64, p, p, p, i64, p, i64, p, i64, p, c_int])
    native.entry_point(lib, "w8a8_gemm_bf16", [p, i64, i64, i64, p, p, p, i64, p, i64, c_int])
    native.entry_point(lib, "w4a16_gemm_bf16", [p, i64, i64, i64, p, p, p, i64, p, i64, c_int])
    lib.quant_gemm_isa.restype = ctypes.c_char_p
    return lib


def isa(extra_flags: tuple[str, ...] = ()) -> str | None:
    """"avx512_vnni", "avx512", "avx2" or "generic": what the build computes with; None without a build."""
    lib = library(extra_flags)
    return None if lib is None else lib.quant_gemm_isa().decode()


@functools.lru_cache(maxsize=None)
def bf16_activations(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether W4A16 takes bf16 activations as they are (AVX512-BF16's vdpbf16ps) in this build."""
    lib = library(extra_flags)
    return lib is not None and lib.quant_gemm_bf16() == 1


def _rows(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """x [..., k] as `dtype` rows [m, k] with unit stride along k (a view where it already is), or None."""
    if x.device.type != "cpu" or x.requires_grad:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != dtype:
        x2 = x2.to(dtype)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def w8a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
         in_features: int, extra_flags: tuple[str, ...] = (), input_scale: torch.Tensor | None = None,
         ) -> torch.Tensor | None:
    """float32 [m, n] of x [..., in]: qweight [n, kp] int8 (kp: in_features padded to 16), scale [n] float32,
    bias [n] float32 or None. bf16 x gives bf16 [m, n] (rounded as `.to(torch.bfloat16)` rounds), in one call with
    x times `input_scale` [in] float32 (SmoothQuant; rounded to bf16 as the reference rounds it) where given;
    float32 x takes no input_scale (the caller's `layer_ops.scale_rows`)."""
    on_bf16 = x.dtype == torch.bfloat16
    lib, rows = library(extra_flags), _rows(x, torch.bfloat16 if on_bf16 else torch.float32)
    if lib is None or rows is None or qweight.shape[1] % 16 or (input_scale is not None and not on_bf16):
        return None
    m, (n, kp) = rows.shape[0], qweight.shape
    out = torch.empty(m, n, dtype=rows.dtype)
    qx, sx = torch.empty(m, kp, dtype=torch.int16), torch.empty(m, dtype=torch.float32)
    with span("matmul"):
        if on_bf16:
            widened = torch.empty(m, in_features, dtype=torch.float32)
            status = lib.w8a8_linear_bf16(rows.data_ptr(), rows.stride(0), m, in_features, _ptr(input_scale),
                                          qweight.data_ptr(), scale.data_ptr(), _ptr(bias), n, kp, out.data_ptr(), n,
                                          widened.data_ptr(), qx.data_ptr(), sx.data_ptr(), torch.get_num_threads())
        else:
            status = lib.w8a8_linear(rows.data_ptr(), rows.stride(0), m, in_features, qweight.data_ptr(),
                                     scale.data_ptr(), _ptr(bias), n, kp, out.data_ptr(), n, qx.data_ptr(),
                                     sx.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def quantize_rows(x: torch.Tensor, kp: int, extra_flags: tuple[str, ...] = ()) -> tuple | None:
    """(q [m, kp] int16, scales [m] float32): the kernel's per-token quantization of x [m, k] float32."""
    lib, rows = library(extra_flags), _rows(x)
    if lib is None or rows is None:
        return None
    m, k = rows.shape
    q, scales = torch.empty(m, kp, dtype=torch.int16), torch.empty(m, dtype=torch.float32)
    lib.quantize_rows(rows.data_ptr(), rows.stride(0), m, k, kp, q.data_ptr(), scales.data_ptr())
    return q, scales


def w8a16(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
          in_features: int, extra_flags: tuple[str, ...] = ()) -> torch.Tensor | None:
    """float32 [m, n] of x [..., in] on int8 weights, the activations in float."""
    lib, rows = library(extra_flags), _rows(x)
    if lib is None or rows is None or in_features % 8:
        return None
    m, (n, kp) = rows.shape[0], qweight.shape
    out = torch.empty(m, n, dtype=torch.float32)
    with span("matmul"):
        status = lib.w8a16_linear(rows.data_ptr(), rows.stride(0), m, in_features, qweight.data_ptr(),
                                  scale.data_ptr(), _ptr(bias), n, kp, out.data_ptr(), n, torch.get_num_threads())
    return out if status == 0 else None


def w4a16(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor, group_size: int,
          bias: torch.Tensor | None, extra_flags: tuple[str, ...] = ()) -> torch.Tensor | None:
    """float32 [m, n] of x [..., in]: packed [n, in / 2] uint8 (kernels.quant_linear.pack_int4's layout), scales
    and scaled_zeros (s * z) [n, in / group_size] float32. bf16 x runs on bf16 products where the CPU has them
    (`bf16_activations`) and gives bf16 [m, n] (rounded as `.to(torch.bfloat16)` rounds), anything else float32."""
    on_bf16 = x.dtype == torch.bfloat16 and bf16_activations(extra_flags)
    lib, rows = library(extra_flags), _rows(x, torch.bfloat16 if on_bf16 else torch.float32)
    if lib is None or rows is None:
        return None
    m, k, n = rows.shape[0], rows.shape[1], packed.shape[0]
    if k % 32 or group_size % 32 or k % group_size:
        return None
    if on_bf16:  # the zero points' part is the kernel's own
        out = torch.empty(m, n, dtype=torch.bfloat16)
        chunked = torch.empty(m, -(-k // 128) * 128, dtype=torch.bfloat16)  # x in the kernel's order
        with span("matmul"):
            status = lib.w4a16_linear_bf16(rows.data_ptr(), rows.stride(0), m, k, packed.data_ptr(),
                                           scales.data_ptr(), scaled_zeros.data_ptr(), group_size, _ptr(bias), n,
                                           out.data_ptr(), n, chunked.data_ptr(), torch.get_num_threads())
        return out if status == 0 else None
    out = zero_point_part(rows, scaled_zeros, group_size)  # [m, n]; the kernel writes the outputs over it
    with span("matmul"):
        status = lib.w4a16_linear(rows.data_ptr(), rows.stride(0), m, k, packed.data_ptr(), scales.data_ptr(),
                                  out.data_ptr(), group_size, _ptr(bias), n, out.data_ptr(), n,
                                  torch.get_num_threads())
    return out if status == 0 else None


def zero_point_part(x32: torch.Tensor, scaled_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """sum_g s z (sum of x over group g) [m, n]: what the zero points take off each output."""
    m, k = x32.shape
    return (x32.view(m, k // group_size, group_size).sum(-1) @ scaled_zeros.T).contiguous()


class CompiledLayerLinear:
    """A quantized linear as the compiled decode layer calls it (worker/fast_paths/native_layer.py):
    small_gemm.SmallLinear's `segments()` (one segment, the linear's struct) plus `gemm`, an entry point of the
    few-row loops' signature that makes the call the linear itself makes, bit for bit. Holds the addresses of the
    linear's buffers: `kept` makes it again when they are other objects. `modes_of`: the linear whose modes are
    read at each call (`serves`; the engine probe switches them for the while)."""

    max_rows = 8  # the most rows `serves` takes

    def __init__(self, linear, modes_of, struct: ctypes.Structure, gemm: int | None):
        self.linear, self.modes_of = linear, modes_of
        self.dtype, self.in_features, self.out_features = linear.dtype, linear.in_features, linear.out_features
        self._struct = struct
        self._pointers = (ctypes.c_void_p * 1)(ctypes.addressof(struct))
        self._rows = (ctypes.c_int64 * 1)(linear.out_features)
        self._biases = (ctypes.c_void_p * 1)(None)
        self.gemm = gemm

    @classmethod
    def kept(cls, linear, modes_of, sources: tuple) -> CompiledLayerLinear:
        """The linear's own, kept on it while `sources` (its buffers, `modes_of`) are the same objects with their
        data where it was (a `.data =` keeps the tensor and moves its data: the struct would read freed memory)."""
        key, addresses = f"_{cls.__name__}", _addresses(sources)
        made = linear.__dict__.get(key)
        if made is None or any(a is not b for a, b in zip(made.sources, sources)) or made.addresses != addresses:
            made = linear.__dict__[key] = cls(linear, modes_of)
            made.sources, made.addresses = sources, addresses
        return made

    def segments(self) -> tuple[int, int, int, int]:
        return (ctypes.addressof(self._pointers), ctypes.addressof(self._rows), ctypes.addressof(self._biases), 1)

    def serves(self, x: torch.Tensor) -> bool:
        """x of the linear's dtype and in_features, 1 to `max_rows` rows, its kernel switched on."""
        return (self.modes_of.use_kernel and x.dtype == self.dtype and x.shape[-1] == self.in_features
                and 0 < x.numel() <= self.max_rows * self.in_features)


def _addresses(sources: tuple) -> tuple:
    return tuple(source.data_ptr() if isinstance(source, torch.Tensor) else None for source in sources)


class _W8A8Struct(ctypes.Structure):  # csrc/quant_gemm.cpp's W8A8Linear
    _fields_ = [("qw", ctypes.c_void_p), ("sw", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("input_scale", ctypes.c_void_p), ("k", ctypes.c_int64), ("kp", ctypes.c_int64), ("n", ctypes.c_int64)]


class FewRowsW8A8(CompiledLayerLinear):
    """A bf16 model's W8A8 linear (`Int8Linear` with act_quant) as the compiled decode layer calls it:
    `w8a8_gemm_bf16`, the linear's own `w8a8_linear_bf16`."""

    def __init__(self, linear, modes_of):
        self.bias = linear.bias32()  # kept: the struct holds its address
        struct = _W8A8Struct(linear.qweight.data_ptr(), linear.weight_scale.data_ptr(), _ptr(self.bias),
                             _ptr(linear.input_scale), linear.in_features, linear.qweight.shape[1],
                             linear.out_features)
        super().__init__(linear, modes_of, struct, ctypes.cast(library().w8a8_gemm_bf16, ctypes.c_void_p).value)

    @classmethod
    def of(cls, linear, modes_of=None) -> FewRowsW8A8 | None:
        """The linear's FewRowsW8A8, or None where it is not a bf16 W8A8 one (its scheme, fixed when made: its
        act_quant may be switched off for the while, see `serves`)."""
        if getattr(linear, "scheme", None) != "w8a8" or not hasattr(linear, "weight_scale") \
                or linear.dtype != torch.bfloat16 or linear.qweight.device.type != "cpu" or library() is None:
            return None
        modes_of = modes_of or linear
        return cls.kept(linear, modes_of, (linear.qweight, linear.weight_scale, linear.bias, linear.input_scale,
                                           modes_of))

    def serves(self, x: torch.Tensor) -> bool:
        """As any compiled-layer linear, with W8A8 switched on."""
        return self.modes_of.act_quant and super().serves(x)


class _W4A16Struct(ctypes.Structure):  # csrc/quant_gemm.cpp's W4A16Linear
    _fields_ = [("packed", ctypes.c_void_p), ("s", ctypes.c_void_p), ("sz", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("k", ctypes.c_int64), ("group", ctypes.c_int64), ("n", ctypes.c_int64)]


class FewRowsW4A16(CompiledLayerLinear):
    """A bf16 model's W4A16 linear (`Int4Linear` in its row-major layout) as the compiled decode layer calls it
    where the CPU multiplies bf16 as it is (`bf16_activations`): `w4a16_gemm_bf16`, the linear's own
    `w4a16_linear_bf16`."""

    def __init__(self, linear, modes_of):
        self.bias, self.scaled_zeros = linear.bias32(), linear.scaled_zeros()  # kept: the struct holds them
        struct = _W4A16Struct(linear.qweight.data_ptr(), linear.scales.data_ptr(), self.scaled_zeros.data_ptr(),
                              _ptr(self.bias), linear.in_features, linear.group_size, linear.out_features)
        super().__init__(linear, modes_of, struct, ctypes.cast(library().w4a16_gemm_bf16, ctypes.c_void_p).value)

    @classmethod
    def of(cls, linear, modes_of=None) -> FewRowsW4A16 | None:
        """The linear's FewRowsW4A16, or None where it is not a bf16 W4A16 one on a CPU with AVX512-BF16, or its
        shapes are not the kernel's (k and the groups whole 32s)."""
        if getattr(linear, "scheme", None) != "w4a16" or getattr(linear, "panels", True) \
                or linear.dtype != torch.bfloat16 or linear.qweight.device.type != "cpu" or not bf16_activations() \
                or linear.in_features % 32 or linear.group_size % 32:
            return None
        modes_of = modes_of or linear
        return cls.kept(linear, modes_of, (linear.qweight, linear.scales, linear.zeros, linear.bias, modes_of))
