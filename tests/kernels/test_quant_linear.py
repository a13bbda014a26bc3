"""The quantized linears (kernels/quant_linear.py): every compiled path (this CPU's build, and the portable loops
built with -mno-avx2 on an AVX2 machine) against the torch reference of its arithmetic."""

from __future__ import annotations

import pytest
import torch

from paged_hf.kernels import quant_gemm
from paged_hf.kernels.quant_linear import (
    Int4Linear,
    Int8Linear,
    pack_int4,
    quantize_int8_per_channel,
    quantize_tokens,
    unpack_int4,
)
from paged_hf.utils import cpu_flags

BUILDS = {"native": (), "portable": quant_gemm.PORTABLE_FLAGS}
SHAPES = [(1, 576, 1536), (7, 64, 33), (5, 128, 7), (130, 256, 100), (4, 96, 3)]


def _build(name: str) -> tuple[str, ...]:
    flags = BUILDS[name]
    if quant_gemm.library(flags) is None:
        pytest.skip("the compiled kernels are unavailable here (no C++ compiler)")
    if name == "portable" and "avx2" not in cpu_flags():
        pytest.skip("the portable loops are this CPU's native build already")
    return flags


def test_the_native_build_uses_avx2_where_the_cpu_has_it():
    _build("native")
    assert quant_gemm.isa() == ("avx2" if {"avx2", "fma"} <= cpu_flags() else "generic")


@pytest.mark.parametrize("build", BUILDS)
def test_token_quantization_equals_the_reference(build):
    flags = _build(build)
    torch.manual_seed(0)
    x = torch.randn(9, 70) * torch.logspace(-3, 3, 9)[:, None]
    x[3] = 0  # an all-zero row: scale 0, every q 0
    q, scales = quant_gemm.quantize_rows(x, 80, flags)
    expected_q, expected_scales = quantize_tokens(x)
    assert torch.equal(q[:, :70].float(), expected_q) and not q[:, 70:].any()
    assert torch.equal(scales, expected_scales)
    assert q.abs().max() == 127


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_w8a8_equals_the_reference_bit_for_bit(build, m, k, n, bias):
    flags = _build(build)
    torch.manual_seed(m + k + n)
    q, scale = quantize_int8_per_channel(torch.randn(n, k))
    q[0, 0] = -128  # full-range int8 weights (compressed-tensors' symmetric rounding reaches -128)
    linear = Int8Linear(q, scale, torch.randn(n) if bias else None, torch.float32, act_quant=True)
    x = torch.randn(m, k) * 4
    got = quant_gemm.w8a8(x, linear.qweight, linear.weight_scale, linear.bias32(), k, flags)
    assert torch.equal(got, linear.reference(x))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_w8a16_matches_the_reference(build, m, k, n):
    flags = _build(build)
    torch.manual_seed(m + k + n)
    q, scale = quantize_int8_per_channel(torch.randn(n, k))
    linear = Int8Linear(q, scale, torch.randn(n), torch.float32, act_quant=False)
    x = torch.randn(m, k)
    got = quant_gemm.w8a16(x, linear.qweight, linear.weight_scale, linear.bias32(), k, flags)
    expected = linear.reference(x)
    assert (got - expected).abs().max() <= 2e-6 * expected.abs().max() * k ** 0.5


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("m, k, n", [s for s in SHAPES if s[1] % 32 == 0])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("zero_points", [True, False])
def test_w4a16_matches_the_reference(build, m, k, n, group_size, zero_points):
    flags = _build(build)
    if k % group_size:
        pytest.skip("the group does not divide in_features")
    torch.manual_seed(m + k + n + group_size)
    groups = k // group_size
    values, scales = torch.randint(0, 16, (n, k)), torch.rand(n, groups) / 10
    zeros = torch.randint(0, 16, (n, groups)) if zero_points else None
    linear = Int4Linear(values, scales, zeros, group_size, torch.randn(n), torch.float32)
    x = torch.randn(m, k)
    got = quant_gemm.w4a16(x, linear.qweight, linear.scales, linear.scaled_zeros(), group_size, linear.bias32(), flags)
    expected = linear.reference(x)
    dense = x @ ((values.float() - linear.zeros.repeat_interleave(group_size, 1)) *
                 scales.repeat_interleave(group_size, 1)).T + linear.bias
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-6 * scale * k ** 0.5
    assert (expected - dense).abs().max() <= 1e-6 * scale * k ** 0.5  # the reference is the dequantized product


def test_int4_packing_round_trips():
    values = torch.randint(0, 16, (5, 96))
    packed = pack_int4(values)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, 96), values.to(torch.uint8))
    assert packed[0, 0] == values[0, 0] | (values[0, 16] << 4)  # k and k + 16 share a byte


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_modules_serve_any_float_dtype_through_the_kernel(dtype):
    torch.manual_seed(1)
    q, scale = quantize_int8_per_channel(torch.randn(48, 64))
    modules = [Int8Linear(q, scale, None, dtype, True), Int8Linear(q, scale, None, dtype, False),
               Int4Linear(torch.randint(0, 16, (48, 64)), torch.rand(48, 2), None, 32, None, dtype)]
    x = torch.randn(2, 3, 64).to(dtype)
    for module in modules:
        got = module(x)
        assert got.dtype == dtype and got.shape == (2, 3, 48)
        module.use_kernel = False
        expected = module(x)
        assert (got.double() - expected.double()).abs().max() <= 1e-5 * expected.double().abs().max() + (
            1e-2 if dtype == torch.bfloat16 else 0)
