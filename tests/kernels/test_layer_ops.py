"""The compiled RMSNorm and SiLU-and-multiply (kernels/layer_ops.py) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from paged_hf.kernels import layer_ops

TOLERANCE = {torch.float32: 2e-7, torch.float64: 1e-14, torch.bfloat16: 0.0}  # bf16: rounded where torch rounds
NORM_TOLERANCE = {**TOLERANCE, torch.float64: 1e-6}  # HF's RMSNorm computes in float32 whatever the dtype


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward (float32 inside, also for a float64 input)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _available(dtype):
    if layer_ops._entry_points(dtype) is None:
        pytest.skip("the compiled ops are unavailable here (no C++ compiler)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows, cols", [(1, 576), (7, 64), (130, 100), (3, 37)])
def test_rms_norm_matches_transformers(dtype, rows, cols):
    _available(dtype)
    torch.manual_seed(rows + cols)
    x, weight = (torch.randn(rows, cols) * 3).to(dtype), torch.randn(cols).to(dtype)
    expected = hf_rms_norm(x, weight, 1e-6)
    got = layer_ops.rms_norm(x, weight, 1e-6)
    scale = expected.double().abs().max()
    assert ((got.double() - expected.double()).abs().max() / scale).item() <= NORM_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (9, 64), (200, 40), (2, 19)])
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    _available(dtype)
    torch.manual_seed(rows + inter)
    gate_up = (torch.randn(1, rows, 2 * inter) * 4).to(dtype)
    gate, up = gate_up.split([inter, inter], dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = layer_ops.silu_and_mul(gate, up)
    assert got.shape == expected.shape
    if dtype == torch.bfloat16:  # silu's exp may differ by an ulp of float before the bf16 rounding
        torch.testing.assert_close(got, expected, atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=TOLERANCE[dtype] or 1e-6)


def test_strided_rows_are_read_in_place_and_uneven_ones_are_refused():
    _available(torch.float32)
    fused = torch.randn(5, 3 * 48)
    q = fused[:, :48]  # a slice of a fused projection: rows 144 elements apart
    weight = torch.randn(48)
    torch.testing.assert_close(layer_ops.rms_norm(q, weight, 1e-5), hf_rms_norm(q, weight, 1e-5))
    heads = fused[:, :48].view(5, 3, 16)  # per-head rows, not evenly strided across tokens
    assert layer_ops.rms_norm(heads, torch.randn(16), 1e-5) is None
    assert layer_ops.rms_norm(torch.randn(4, 8, dtype=torch.float16), torch.randn(8, dtype=torch.float16), 1e-5) is None
    assert layer_ops.silu_and_mul(torch.randn(3, 7), torch.randn(3, 6)) is None  # shapes differ


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor [tokens, heads, head_dim], cos/sin [tokens, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("head_dim", [16, 40, 64])  # half a head: one at a time; 16 lanes and a tail; 16 lanes x 2
def test_rotary_in_place_matches_transformers_and_leaves_v_alone(dtype, head_dim):
    _available(dtype)
    torch.manual_seed(3)
    tokens, q_heads, kv_heads = 11, 4, 2
    qkv = torch.randn(1, tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.randn(1, tokens, head_dim // 2).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, v = (t.reshape(tokens, -1, head_dim) for t in qkv[0].split([q_heads * head_dim, kv_heads * head_dim,
                                                                       kv_heads * head_dim], dim=-1))
    expected_q, expected_k, expected_v = hf_rotary(q, cos[0], sin[0]), hf_rotary(k, cos[0], sin[0]), v.clone()
    assert layer_ops.rotate_in_place(qkv, cos, sin, q_heads + kv_heads, head_dim)
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 0.0, torch.float64: 1e-15}[dtype]
    for got, expected in ((q, expected_q), (k, expected_k), (v, expected_v)):
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert not layer_ops.rotate_in_place(qkv, cos[..., :8], sin[..., :8], q_heads, head_dim)  # partial rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("cols", [7, 16, 33, 49155])
def test_argmax_rows_is_torch_max_indices_with_ties_nans_and_infinities(dtype, cols):
    """The greedy sampler's tokens: the first maximal index (ties), a NaN counting as the maximum (the first NaN),
    rows of -inf, +inf twice, and a maximum in the tail past the last full 16 lanes."""
    _available(dtype)
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
    x[1, 5], x[1, 2] = float("nan"), float("nan")
    x[2] = float("-inf")
    x[3] = 1.0
    x[4, cols - 1] = 100.0
    x[5, cols // 2], x[5, cols // 3] = float("inf"), float("inf")
    x[6, 0] = 50.0
    assert layer_ops.argmax_rows(x) == x.max(dim=-1).indices.tolist()
    assert layer_ops.argmax_rows(x[:, : cols - 1]) == x[:, : cols - 1].max(dim=-1).indices.tolist()  # strided rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows, cols", [(1, 576), (7, 64), (130, 100), (3, 37)])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, rows, cols):
    """The sum bit for bit torch's add (rounded where torch rounds), the norm bit for bit the compiled RMSNorm's
    of that sum (which test_rms_norm_matches_transformers holds to HF's)."""
    _available(dtype)
    torch.manual_seed(rows * cols)
    x, h, weight = (torch.randn(rows, cols) * 3).to(dtype), torch.randn(rows, cols).to(dtype), torch.randn(cols).to(dtype)
    total, normed = layer_ops.add_rms_norm(x, h, weight, 1e-6)
    assert torch.equal(total, x + h)
    assert torch.equal(normed, layer_ops.rms_norm(x + h, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scatter_rows_is_the_caches_index_copy_and_refuses_what_it_cannot_copy_as_rows(dtype):
    """K of a fused q/k/v output (token rows a row stride apart, heads contiguous) into scattered cache slots."""
    _available(dtype)
    qkv = torch.randn(7, 9 * 16 + 2 * 3 * 16).to(dtype)
    key = qkv[:, 144:192].view(7, 3, 16)
    cache = torch.zeros(20, 4, 3, 16, dtype=dtype)
    expected = cache.clone()
    slots = torch.tensor([5, 0, 79, 33, 34, 35, 12])
    assert layer_ops.scatter_rows(key, cache, slots)
    expected.view(-1, 3, 16).index_copy_(0, slots, key)
    assert torch.equal(cache, expected)
    assert not layer_ops.scatter_rows(key.transpose(1, 2), cache, slots)  # heads not contiguous
    assert not layer_ops.scatter_rows(key, cache.to(torch.float16), slots)  # another dtype
    assert not layer_ops.scatter_rows(key, cache, slots.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scale_rows_rounds_as_torch_does(dtype):
    """A quantized linear's smoothed input in one pass: `(x.float() * s).to(x.dtype).float()` bit for bit, from
    rows read in place (a slice of a wider tensor)."""
    _available(dtype)
    torch.manual_seed(7)
    x = (torch.randn(37, 100) * 3).to(dtype)[:, :96]
    scale = torch.rand(96) * 2
    assert torch.equal(layer_ops.scale_rows(x, scale), (x.float() * scale).to(dtype).float())
    assert layer_ops.scale_rows(x, torch.rand(95)) is None  # one scale per column or nothing
