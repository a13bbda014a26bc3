"""The quantized linears (kernels/quant_linear.py): every compiled path against the torch reference of its
arithmetic: this CPU's build, and on an AVX-512 machine the builds without AVX512-VNNI (W8A8 on the AVX2 loops) and
without AVX-512 (the AVX2 loops alone), and on an AVX2 machine the portable loops built with -mno-avx2. The shapes
take every AVX-512 path (W8A8: AVX2 loops for 1-2 rows, vpdpbusd panels from 3; W8A16/W4A16: few rows up to 11,
float panels from 12), with partial tiles, panels, blocks, steps and k chunks."""

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

AVX512 = frozenset({"avx2", "fma", "avx512f", "avx512bw"})
VNNI = AVX512 | {"avx512_vnni"}
BUILDS = {"native": (), "avx512": ("-mno-avx512vnni",), "avx2": quant_gemm.AVX2_FLAGS,
          "portable": quant_gemm.PORTABLE_FLAGS}
#: the CPU flags without which a build is this CPU's native one (or less) already
NEEDS = {"avx512": VNNI, "avx2": AVX512, "portable": frozenset({"avx2"})}
SHAPES = [(1, 576, 1536), (2, 96, 40), (7, 64, 33), (5, 128, 7), (130, 256, 100), (4, 96, 3), (37, 640, 70),
          (300, 64, 50)]
needs_vnni = pytest.mark.skipif(not VNNI <= cpu_flags(), reason="this CPU has no AVX512-VNNI (avx512_vnni)")
needs_bf16 = pytest.mark.skipif(not AVX512 | {"avx512_bf16"} <= cpu_flags(),
                                reason="this CPU has no AVX512-BF16 (avx512_bf16)")


def _build(name: str) -> tuple[str, ...]:
    flags = BUILDS[name]
    if quant_gemm.library(flags) is None:
        pytest.skip("the compiled kernels are unavailable here (no C++ compiler)")
    if not NEEDS.get(name, frozenset()) <= cpu_flags():
        pytest.skip(f"the {name} build is this CPU's native build already")
    return flags


def test_the_native_build_uses_the_widest_instructions_the_cpu_has():
    _build("native")
    flags = cpu_flags()
    expected = ("avx512_vnni" if VNNI <= flags else "avx512" if AVX512 <= flags else
                "avx2" if {"avx2", "fma"} <= flags else "generic")
    assert quant_gemm.isa() == expected
    if AVX512 <= flags:
        assert quant_gemm.isa(BUILDS["avx2"]) == "avx2"
    if VNNI <= flags:
        assert quant_gemm.isa(BUILDS["avx512"]) == "avx512"


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
    # 127 / amax rounded once (torch's `127.0 / amax` is its reciprocal times 127: here x * inv = -43.5 instead)
    row = torch.tensor([[10.84673023223877, -3.7152185440063477]])
    assert quant_gemm.quantize_rows(row, 16, flags)[0][0, 1] == quantize_tokens(row)[0][0, 1] == -43


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
@pytest.mark.parametrize("smoothed", [True, False])
def test_w8a8_on_bf16_equals_the_reference_rounded_to_bf16(build, m, k, n, smoothed):
    """bf16 x in one call (the smoothing's product rounded to bf16, the outputs rounded to bf16 in the epilogue):
    the reference's float32 outputs `.to(bfloat16)`, bit for bit, on every path (1-2 rows, panels, AVX2 loops)."""
    flags = _build(build)
    torch.manual_seed(m + k + n)
    q, scale = quantize_int8_per_channel(torch.randn(n, k))
    input_scale = torch.rand(k) * 4 + 0.1 if smoothed else None
    bias = torch.randn(n)
    bias[1] = float("nan")  # a NaN channel: NaN out (quiet; its sign and payload are the CPU's, not torch's)
    linear = Int8Linear(q, scale, bias, torch.bfloat16, act_quant=True, input_scale=input_scale)
    x = (torch.randn(m, k) * 4).to(torch.bfloat16)
    got = quant_gemm.w8a8(x, linear.qweight, linear.weight_scale, linear.bias32(), k, flags,
                          input_scale=linear.input_scale)
    expected = linear.reference(x)
    assert got.dtype == expected.dtype == torch.bfloat16 and got[:, 1].isnan().all() and expected[:, 1].isnan().all()
    got[:, 1] = expected[:, 1] = 0
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


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
@pytest.mark.parametrize("m, k, n, group_size", [(*s, g) for s in SHAPES for g in (32, 64, 128, 320) if s[1] % g == 0])
@pytest.mark.parametrize("zero_points", [True, False])
def test_w4a16_matches_the_reference(build, m, k, n, group_size, zero_points):
    flags = _build(build)
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


@needs_bf16
@pytest.mark.parametrize("m, k, n, group_size", [(*s, g) for s in SHAPES for g in (32, 64, 128, 320) if s[1] % g == 0])
@pytest.mark.parametrize("zero_points", [True, False])
def test_w4a16_on_bf16_activations_matches_the_reference(m, k, n, group_size, zero_points):
    """bf16 x on vdpbf16ps (kernels/csrc/quant_gemm_bf16.h), bf16 out: the float32 reference of the same x, to the
    sum order's error and one bf16 rounding of the output."""
    if quant_gemm.library() is None:
        pytest.skip("the compiled kernels are unavailable here (no C++ compiler)")
    assert quant_gemm.bf16_activations() and not quant_gemm.bf16_activations(quant_gemm.AVX2_FLAGS)
    torch.manual_seed(m + k + n + group_size)
    values, scales = torch.randint(0, 16, (n, k)), torch.rand(n, k // group_size) / 10
    zeros = torch.randint(0, 16, (n, k // group_size)) if zero_points else None
    linear = Int4Linear(values, scales, zeros, group_size, torch.randn(n), torch.float32)
    x = torch.randn(m, k).to(torch.bfloat16)
    x[0, :3] = torch.tensor([1e4, -1e4, 1e-3])  # a row of mixed magnitudes
    got = quant_gemm.w4a16(x, linear.qweight, linear.scales, linear.scaled_zeros(), group_size, linear.bias32())
    expected = linear.reference(x.float())
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    error = (got.float() - expected).abs()
    assert (error <= expected.abs() * 2 ** -8 + 1e-6 * expected.abs().max() * k ** 0.5).all()


@needs_bf16
def test_w4a16_on_bf16_activations_gives_a_row_the_same_outputs_in_any_batch():
    torch.manual_seed(6)
    m, k, n, group = 40, 640, 70, 64
    int4 = Int4Linear(torch.randint(0, 16, (n, k)), torch.rand(n, k // group), torch.randint(0, 16, (n, k // group)),
                      group, torch.randn(n), torch.bfloat16)

    def run(rows):
        return quant_gemm.w4a16(rows, int4.qweight, int4.scales, int4.scaled_zeros(), group, int4.bias32())

    x = torch.randn(m, k).to(torch.bfloat16)
    whole = run(x)
    assert torch.equal(torch.cat([run(x[i:i + 1]) for i in range(m)]), whole)
    assert torch.equal(torch.cat([run(x[i:i + 5]) for i in range(0, m, 5)]), whole)


@needs_vnni
@pytest.mark.parametrize("m, k, n", [(3, 2064, 45), (64, 1040, 100), (25, 4096, 64),
                                     (1, 2064, 45), (1, 48, 7), (2, 80, 13), (2, 576, 1541)])  # (1-2 rows: 4 at a step)
def test_w8a8_on_vnni_equals_the_avx2_loops_exactly(m, k, n):
    """vpdpbusd's u8 x s8 with the +128 shift taken off per row: the same integers as the AVX2 build's int16
    pairs, on full-range weights (-128..127) and activations that reach +-127, over long sums."""
    _build("avx2")
    torch.manual_seed(m + k + n)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    q[0] = -128
    q[1] = 127
    linear = Int8Linear(q, torch.rand(n) / 100, torch.randn(n), torch.float32, act_quant=True)
    x = torch.randn(m, k) * torch.logspace(-4, 4, m)[:, None]
    x[0, :] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)  # every q_x at +-127
    x[1:2] = 0  # (a zero row where there are two)
    got = quant_gemm.w8a8(x, linear.qweight, linear.weight_scale, linear.bias32(), k)
    assert torch.equal(got, quant_gemm.w8a8(x, linear.qweight, linear.weight_scale, linear.bias32(), k,
                                            BUILDS["avx2"]))
    assert torch.equal(got, linear.reference(x))


@pytest.mark.parametrize("build", BUILDS)
def test_float_paths_give_a_row_the_same_outputs_in_any_batch(build):
    """Each output's sum runs in one order whatever the number of rows (the engine's probe compares a prompt's
    forward with its chunks and decodes): a row alone, in a few rows or in a panel-sized batch, bit for bit."""
    flags = _build(build)
    torch.manual_seed(5)
    m, k, n, group = 40, 640, 70, 64
    q, scale = quantize_int8_per_channel(torch.randn(n, k))
    int8 = Int8Linear(q, scale, torch.randn(n), torch.float32, act_quant=False)
    int4 = Int4Linear(torch.randint(0, 16, (n, k)), torch.rand(n, k // group), None, group, torch.randn(n),
                      torch.float32)
    no_zeros = torch.zeros_like(int4.scales)  # the zero points' share is a torch matmul, not the kernel's sums
    runs = {"w8a16": lambda rows: quant_gemm.w8a16(rows, int8.qweight, int8.weight_scale, int8.bias32(), k, flags),
            "w4a16": lambda rows: quant_gemm.w4a16(rows, int4.qweight, int4.scales, no_zeros, group, int4.bias32(),
                                                   flags)}
    x = torch.randn(m, k)
    for run in runs.values():
        whole = run(x)
        assert torch.equal(torch.cat([run(x[i:i + 1]) for i in range(m)]), whole)
        assert torch.equal(torch.cat([run(x[i:i + 5]) for i in range(0, m, 5)]), whole)


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


def test_smoothed_w8a8_computes_the_same_linear_with_less_error_on_outlier_channels():
    """SmoothQuant inside the module (input_scale = 1 / s, weight quantized times s): x W^T still, the kernel equal
    to the reference bit for bit, and nearer the float linear when a few input channels are 50x the others."""
    from paged_hf.loader.smoothing import smoothing_scale  # noqa: PLC0415

    torch.manual_seed(2)
    weight = torch.randn(96, 128) * 0.05
    x = torch.randn(40, 128)
    x[:, [3, 70]] *= 50.0  # outlier channels, as the inputs of q/k/v and down_proj have
    exact = x @ weight.T
    plain = Int8Linear(*quantize_int8_per_channel(weight), None, torch.float32, True)
    s = smoothing_scale(x.abs().amax(0), weight)
    smoothed = Int8Linear(*quantize_int8_per_channel(weight * s), None, torch.float32, True, input_scale=1 / s)
    got = smoothed(x)
    smoothed.use_kernel = False
    assert torch.equal(got, smoothed(x))
    error, plain_error = (got - exact).abs().mean(), (plain(x) - exact).abs().mean()
    assert error < 0.5 * plain_error, (error, plain_error)
