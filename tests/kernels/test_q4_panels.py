"""W4A8 on repacked 4-bit panels (kernels/q4_panels.py, csrc/q4_panels.cpp): the repack round-trips, every build this
CPU can run (AVX512-VNNI, the AVX2 loops built with -mno-avx512f, the portable loops with -mno-avx2) equals the torch
reference for 1..8 rows and odd shapes, in float32 and bf16, and `Int4Linear(act_quant=True)` computes it, stacked
and with its panels switched off (the engine probe's W4A16 arithmetic); its scales and zero points are float16."""

from __future__ import annotations

import pytest
import torch

from paged_hf.kernels import q4_panels
from paged_hf.kernels.quant_linear import Int4Linear, quantize_int4_groups, stack_linears
from paged_hf.utils import cpu_flags

BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2", "-mno-fma")}
#: the CPU flags a build needs to differ from the native one and run here
NEEDS = {"native": frozenset(), "avx2": frozenset({"avx512f", "avx2", "fma"}), "portable": frozenset({"avx2"})}
#: (rows, out_features, in_features, group): 1..8 rows, one panel, odd block counts, a group of 32, 9+ rows
SHAPES = [(1, 16, 32, 32), (2, 48, 96, 32), (3, 64, 192, 64), (4, 32, 320, 64), (5, 80, 128, 128), (6, 16, 64, 64),
          (7, 112, 224, 32), (8, 576, 576, 64), (11, 32, 128, 64)]


def _flags(build: str) -> tuple[str, ...]:
    if q4_panels.library(BUILDS[build]) is None:
        pytest.skip("the compiled kernels are unavailable here (no C++ compiler)")
    if not NEEDS[build] <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {build} build as a build of its own")
    return BUILDS[build]


def _weights(n: int, k: int, group: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return quantize_int4_groups(torch.randn(n, k, generator=generator), group)


def _as_kept(scales: torch.Tensor) -> torch.Tensor:
    """Scales as the kernel reads them: rounded to float16."""
    return scales.half().float()


def test_the_native_build_names_its_instructions():
    _flags("native")
    flags = cpu_flags()
    expected = ("avx512_vnni" if {"avx512f", "avx512bw", "avx512_vnni", "fma"} <= flags else
                "avx2" if {"avx2", "fma"} <= flags else "generic")
    assert q4_panels.isa() == expected
    if NEEDS["avx2"] <= flags:
        assert q4_panels.isa(BUILDS["avx2"]) == "avx2"
    if NEEDS["portable"] <= flags:
        assert q4_panels.isa(BUILDS["portable"]) == "generic"


def test_the_repack_round_trips():
    values, scales, zeros = _weights(48, 192, 64)
    panels = q4_panels.repack(values)
    assert panels.shape == (3, 192 // 32 * 256) and panels.dtype == torch.uint8
    assert torch.equal(q4_panels.unrepack(panels, 192), values)
    assert torch.equal(q4_panels.unrepack_groups(q4_panels.repack_groups(scales)), scales)
    halves = q4_panels.half_groups(scales)
    assert halves.dtype == torch.float16 and torch.equal(q4_panels.unrepack_groups(halves).float(), _as_kept(scales))
    assert torch.equal(q4_panels.unrepack_groups(q4_panels.half_groups(zeros)).float(), zeros)  # integers: exact
    # channel 17's k = 40..43 and 44..47: panel 1, block 1, t = 1, its 4 bytes at 4 * 1
    byte = panels[1, 256 + 64 + 4:256 + 64 + 8]
    assert torch.equal(byte & 15, values[17, 40:44]) and torch.equal(byte >> 4, values[17, 44:48])


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_reference(build, dtype):
    flags = _flags(build)
    for index, (m, n, k, group) in enumerate(SHAPES):
        values, scales, zeros = _weights(n, k, group, index)
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(100 + index)) * 3).to(dtype)
        x[0, :32] = 0  # an all-zero block: scale 0, q 0
        bias = torch.randn(n).to(dtype)
        got = q4_panels.linear(x, q4_panels.repack(values), q4_panels.half_groups(scales),
                               q4_panels.half_groups(zeros), group, bias, flags)
        expected = (q4_panels.reference(x.float(), values, _as_kept(scales), zeros, group) + bias.float()).to(dtype)
        assert got is not None and got.dtype == dtype
        tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, expected, **tolerance, msg=f"{build} {dtype} {(m, n, k, group)}")


def test_the_reference_quantizes_each_block_of_32():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 32] = 2.0, 1.0, 0.5
    q, sx = q4_panels.quantize_blocks(x)
    assert torch.equal(sx, torch.tensor([[2.0 / 127, 0.5 / 127]]))
    assert q[0, 0, 0] == 127 and q[0, 0, 1] == 64 and q[0, 1, 0] == 127  # 63.5 rounds half to even


def test_w4a8_linear_stacks_and_keeps_the_w4a16_arithmetic_when_switched_off():
    parts = [Int4Linear(*_weights(n, 128, 64, n), 64, torch.randn(n), torch.float32, act_quant=True)
             for n in (32, 16, 48)]
    assert parts[0].scheme == "w4a8" and parts[0].qweight.shape == (2, 4 * 256)
    x = torch.randn(3, 128)
    separate = torch.cat([part(x) for part in parts], -1)
    stack = stack_linears(parts)
    assert stack is not None and stack.panels and stack.qweight.shape[0] == 6
    torch.testing.assert_close(stack(x), separate, rtol=0, atol=0)
    values, scales, zeros = parts[1].unpacked()
    plain = Int4Linear(values, scales, zeros, 64, parts[1].bias, torch.float32)
    for part in (parts[1], plain):
        part.act_quant = False
    torch.testing.assert_close(parts[1](x), plain.reference(x), rtol=1e-5, atol=1e-5)
    # the switched-off panels compute s * z for the call and keep nothing beside the panels (100 MB on a 1B model)
    assert parts[1].__dict__.get("_scaled_zeros") is None and plain.__dict__.get("_scaled_zeros") is not None
    with pytest.raises(ValueError, match="W4A8"):
        Int4Linear(*_weights(24, 128, 64), 64, None, torch.float32, act_quant=True)


def test_w4a8_keeps_float16_scales_and_refuses_float32_ones():
    """The panels' scales and zero points are float16 (a fifth of the bytes read in float32): kept so by
    Int4Linear, and a float32 pair is refused, never read as float16 bits."""
    values, scales, zeros = _weights(32, 128, 64)
    linear = Int4Linear(values, scales, zeros, 64, None, torch.float32, act_quant=True)
    assert linear.scales.dtype == linear.zeros.dtype == torch.float16
    _, kept_scales, kept_zeros = linear.unpacked()
    assert torch.equal(kept_scales, _as_kept(scales)) and torch.equal(kept_zeros, zeros)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="float16"):
        q4_panels.linear(x, linear.qweight, q4_panels.repack_groups(scales), linear.zeros, 64, None)
