"""The compiled bf16 prefill kernel (kernels/csrc/paged_prefill.cpp) against dense float64 attention over the
same bf16 K/V, the reference the torch kernel meets too (tests/kernels/test_kernels.py), on random paged batches
that mix fresh prompts, chunks with a past and decodes. Each case runs on every path this CPU has: AVX512-BF16,
AMX tiles (skipped without AMX), and AMX's tiles emulated in plain C++ (the AMX path's layouts on any CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import plans_compiled_prefills
from test_kernels import check_against_dense

from paged_hf.kernels import native
from paged_hf.kernels.cpu_kernel import CpuKernel
from paged_hf.kernels.torch_kernel import TorchKernel


def has_prefill_kernel() -> bool:
    return native.load_paged_prefill(64) is not None


def has_amx() -> bool:
    return has_prefill_kernel() and "amx_bf16" in native.prefill_isas(native.load_paged_prefill(64))


pytestmark = pytest.mark.skipif(not has_prefill_kernel(), reason="this CPU has no AVX512-BF16 (avx512_bf16): "
                                "bf16 prefill chunks stay with torch's SDPA")


@pytest.fixture(params=["avx512_bf16", "amx_bf16", "amx_bf16_emulated"])
def isa(request):
    if request.param == "amx_bf16" and not has_amx():
        pytest.skip("this CPU has no AMX (amx_bf16), or Linux does not let this process use its tiles")
    return request.param


@pytest.fixture
def no_sdpa_prefills(monkeypatch):
    """Any prefill chunk that reached torch's SDPA path fails the test: the compiled kernel must serve them all."""
    def refuse(*args, **kwargs):
        raise AssertionError("a prefill chunk went to the torch kernel")

    monkeypatch.setattr(TorchKernel, "attend_prefills", refuse)


def check(shapes, *, isa, num_heads, num_kv_heads, head_dim, block_size=16, window=None, softcap=None, seed=0):
    kernel = CpuKernel(torch.bfloat16, [head_dim], prefill_isa=isa)
    assert plans_compiled_prefills(kernel) and kernel.prefill_isa == isa.removesuffix("_emulated")
    check_against_dense(kernel, shapes, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=block_size, dtype=torch.bfloat16, window=window, softcap=softcap, seed=seed)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (16, 2, 64), (6, 2, 128)])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (20, 10.0)])
def test_mixed_step_of_prompts_chunks_and_decodes(num_heads, num_kv_heads, head_dim, window, softcap, isa,
                                                  no_sdpa_prefills):
    # (cached, new): fresh prompts longer and shorter than a tile, chunks with a past, a speculative-decoding-like
    # short query on a long context, decodes; no context a multiple of the block size
    shapes = [(0, 70), (100, 1), (0, 17), (45, 23), (61, 2), (0, 1), (130, 48), (5, 33), (250, 5), (3, 1)]
    check(shapes, isa=isa, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, window=window,
          softcap=softcap)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, past", [(9, 3, 64, 0), (9, 3, 64, 29), (4, 4, 128, 0),
                                                                     (4, 4, 128, 50)])
def test_every_query_length_up_to_70(num_heads, num_kv_heads, head_dim, past, isa, no_sdpa_prefills):
    """Query lengths 2..70 in one step: every remainder of the tile (16 tokens at 3 heads per KV head, 48 at 1)."""
    shapes = [(past + length % 7, length) for length in range(2, 71)]
    check(shapes, isa=isa, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=5, seed=past)


@pytest.mark.parametrize("seed", range(3))
def test_long_prompt_with_window_shorter_than_a_key_block(seed, isa, no_sdpa_prefills):
    """A 300-token prompt and a chunk after a 400-token past, with a window of 7 (keys masked on both sides)."""
    check([(0, 300), (400, 64)], isa=isa, num_heads=9, num_kv_heads=3, head_dim=64, window=7, seed=seed)


def test_other_dtypes_and_head_dims_keep_sdpa():
    assert plans_compiled_prefills(CpuKernel(torch.bfloat16, [64]))
    assert not plans_compiled_prefills(CpuKernel(torch.bfloat16, [16]))  # head_dim not a multiple of 32
    assert not plans_compiled_prefills(CpuKernel(torch.bfloat16, [64, 48]))  # one layer's head_dim does not fit: none
    assert not plans_compiled_prefills(CpuKernel(torch.float32, [64]))
    assert not plans_compiled_prefills(CpuKernel(torch.float16, [64]))
    assert not plans_compiled_prefills(CpuKernel(torch.bfloat16, [64], torch.int8))  # a quantized cache


def test_too_many_query_heads_per_kv_head_go_to_sdpa():
    """64 query heads on one KV head do not fit a 48-row tile: SDPA serves them (and still matches)."""
    check_against_dense(CpuKernel(torch.bfloat16, [32]), [(0, 5), (7, 3), (4, 1)], num_heads=64, num_kv_heads=1,
                        head_dim=32, block_size=4, dtype=torch.bfloat16, window=None, softcap=None, seed=0)


def test_the_fastest_path_this_cpu_has_is_the_default():
    """AMX where the CPU has it and Linux lets the process use its tiles, else AVX512-BF16; asking for a path the
    CPU lacks is an error, not a silent fallback."""
    assert CpuKernel(torch.bfloat16, [64]).prefill_isa == ("amx_bf16" if has_amx() else "avx512_bf16")
    assert CpuKernel(torch.bfloat16, [64], prefill_isa="avx512_bf16").prefill_isa == "avx512_bf16"
    if not has_amx():
        with pytest.raises(ValueError, match="amx_bf16"):
            CpuKernel(torch.bfloat16, [64], prefill_isa="amx_bf16")
    with pytest.raises(ValueError, match="amx_bf16"):
        CpuKernel(torch.float32, [64], prefill_isa="amx_bf16")  # float32 chunks never reach the bf16 kernel


def test_the_amx_build_compiles_here_and_refuses_tiles_the_cpu_lacks():
    """AMX's instructions compiled in on any CPU: the build succeeds, and where the CPU has no AMX (or Linux
    refuses its tiles) the library says its AMX entry point is unusable, so the kernel never calls it."""
    try:
        library = native.load_paged_prefill(64, native.TARGET_AMX)
    except native.NativeBuildError as error:
        pytest.skip(f"this compiler cannot target AMX: {error}")
    assert library is not None and callable(library.paged_prefill_amx_bfloat16)
    assert ("amx_bf16" in native.prefill_isas(library)) == has_amx()
