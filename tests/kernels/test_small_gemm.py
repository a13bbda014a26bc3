"""Linears at a few rows (kernels/small_gemm.py): the float64 reference's values within each dtype's rounding, for
every row count, tails of k and of the rows, several weights side by side and biases, in this CPU's build and in
the AVX2 build; the same bits whatever the thread count; the loop without AVX512-BF16 too; and the engine's decode
steps through it."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import small_gemm
from paged_hf.kernels.small_gemm import SmallLinear
from paged_hf.utils import cpu_flags

pytestmark = pytest.mark.skipif(not small_gemm.functions(), reason="the small-row loops need AVX-512 or AVX2")

#: this CPU's build, and the AVX2 build (AMD Zen 2/3) where the CPU runs AVX2 and FMA
BUILDS = [pytest.param((), id="native"),
          pytest.param(("-mno-avx512f",), id="avx2", marks=pytest.mark.skipif(
              not {"avx2", "fma"} <= cpu_flags(), reason="the AVX2 loops need AVX2 and FMA"))]


def _case(dtype, m, k, rows, bias, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(n, k, generator=generator) / k ** 0.5).to(dtype) for n in rows]
    biases = [torch.randn(n, generator=generator).to(dtype) if bias else None for n in rows]
    x = torch.randn(m, k, generator=generator).to(dtype)
    expected = torch.cat([torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
                          for w, b in zip(weights, biases)], dim=-1)
    return weights, biases, x, expected


def _check(out, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # float32 sums in another order, one rounding to bf16: within one bf16 step of the exact value
        step = expected.abs().clamp(min=1e-3) * 2 ** -7
        assert ((out.double() - expected).abs() <= step).all()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("k, rows, bias", [(576, [576, 192, 192], False), (40, [7], True), (100, [5, 3, 9], True),
                                           (1536, [576], False), (33, [64, 1], False)])
def test_small_rows_equal_the_reference_within_rounding(build, dtype, m, k, rows, bias):
    weights, biases, x, expected = _case(dtype, m, k, rows, bias)
    linear = SmallLinear(weights, biases, build)
    assert SmallLinear.usable(weights, biases) and linear.function is small_gemm.functions(build)[dtype]
    _check(linear(x), expected, dtype)


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="the AVX2 loops need AVX2 and FMA")
def test_the_build_says_what_it_computes_with():
    """A CPU with AVX2 but not AVX-512 gets the 8-float loops of its own (the engine no longer falls back to
    oneDNN at a few rows there); without AVX2 either, nothing is built and the engine keeps its GEMM."""
    assert small_gemm.isa(("-mno-avx512f",)) == "avx2"
    neither = ("-mno-avx512f", "-mno-avx2")
    assert small_gemm.isa(neither) == "" and not small_gemm.functions(neither)
    native = small_gemm.isa()
    assert native == ("avx512_bf16" if "avx512_bf16" in cpu_flags() else "avx512" if "avx512f" in cpu_flags()
                      else "avx2")
    # the rows each build serves (bf16, float32): past a linear's own limit only where a whole compiled layer pays
    rows = {"avx512_bf16": [4, 8], "avx512": [2, 8], "avx2": [2, 4], "": [0, 0]}
    for flags in ((), ("-mno-avx512f",), neither):
        assert [small_gemm.max_rows(dtype, flags) for dtype in (torch.bfloat16, torch.float32)] == \
            rows[small_gemm.isa(flags)]
    assert SmallLinear(*_case(torch.bfloat16, 1, 64, [8], False)[:2]).max_rows == small_gemm.max_rows(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_bits_whatever_the_threads_and_the_rows_layout(dtype):
    """A row is computed whole by one thread: the thread count does not change a bit; x as [1, 1, k] or with rows
    further apart (a slice of a wider tensor) neither."""
    weights, biases, x, _ = _case(dtype, 2, 576, [960, 3], True)
    linear = SmallLinear(weights, biases)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, linear(x))
    wide = torch.zeros(2, 600, dtype=dtype)
    wide[:, :576] = x
    assert torch.equal(linear(wide[:, :576]), one)
    assert torch.equal(linear(x[:1].view(1, 1, 576)), one[:1].view(1, 1, -1))


def test_what_it_does_not_serve_is_left_to_the_callers_gemm():
    weights, biases, x, _ = _case(torch.float32, 2, 64, [8], False)
    linear = SmallLinear(weights, biases)
    assert linear.serves(x) and not linear.serves(torch.zeros(small_gemm.max_rows(torch.float32) + 1, 64))
    assert not linear.serves(x.to(torch.bfloat16)) and not linear.serves(torch.zeros(2, 64).t().contiguous().t()[:, :1])
    assert not SmallLinear.usable([torch.zeros(4, 8, dtype=torch.float64)], [None])
    assert not SmallLinear.usable([torch.zeros(8, 4).t()], [None])  # not row-major


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the CPU computes bf16 products natively only with it")
@pytest.mark.parametrize("m", [1, 3])  # one row of W at a time at one row of x, a few at once past it
def test_the_loop_for_cpus_without_avx512_bf16_gives_the_same_values(m):
    """Built with -mno-avx512bf16 (Ice Lake, Skylake-X): bf16 widened to float32 and FMAs."""
    functions = small_gemm.functions(("-mno-avx512bf16",))
    weights, biases, x, expected = _case(torch.bfloat16, m, 200, [70, 9], True)
    linear = SmallLinear(weights, biases, ("-mno-avx512bf16",))
    assert linear.function is functions[torch.bfloat16]
    _check(linear(x), expected, torch.bfloat16)


def test_a_decode_step_of_one_request_runs_through_it_and_gives_hfs_tokens(monkeypatch):
    """float32: the default path's tokens are HF's; every linear of a decode step (and the LM head) took the
    small-row loops: the layers' through the compiled layer's calls of the same loops (worker/fast_paths/
    native_layer.py) and the LM head through the stack's call of them (stack_tail.py), or each through SmallLinear
    where the compiled layer is off."""
    model = tiny_model("llama", dtype=torch.float32)
    prompt = random_prompts([12])[0]
    expected = hf_greedy(model, prompt, 8)
    calls = []
    original = SmallLinear.__call__
    monkeypatch.setattr(SmallLinear, "__call__", lambda self, x: calls.append(self.out_features) or original(self, x))
    for native in (True, False):
        engine = paged_hf.wrap(model, num_blocks=32).generator
        layers = engine.runner.fused_layers.lean.native
        tail = engine.runner.llama_forward.tail
        layers.enabled, before, heads_before = native, layers.layers_served, tail.served
        calls.clear()
        output = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0), use_tqdm=False)[0]
        assert output.outputs[0].token_ids == expected
        served, heads = layers.layers_served - before, tail.served - heads_before
        assert 4 * served + len(calls) + heads >= 7 * (2 * 4 + 1)  # 2 layers' q/k/v, o_proj, gate/up, down; the head
        assert calls.count(model.config.vocab_size) + heads >= 7 and (served > 0) is native and (heads > 0) is native
