"""GPTQ at load (paged_hf/loader/gptq.py, `quantization="w4a16_gptq"`): the round-to-nearest grid with values
chosen against the inputs' Hessian, on calibration text the model writes itself; served by the same Int4Linear
(the engine's tokens equal plain HF's on the quantized model: tests/loader/test_quantized.py)."""

from __future__ import annotations

import torch

from paged_hf.kernels.quant_linear import Int4Linear, quantize_int4_groups
from paged_hf.loader import gptq
from paged_hf.loader.gptq import gptq_int4, self_generated_ids
from paged_hf.loader.quantized import quantize_model
from tests.loader.quant_folders import tiny_llama


def dequantized(values, scales, zeros, group_size):
    n, k = values.shape
    u = values.float().view(n, k // group_size, group_size)
    return ((u - zeros[:, :, None]) * scales[:, :, None]).view(n, k)


def correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels are correlated and of unequal size, as a layer's activations are."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(k // 4, k, generator=generator)
    sizes = torch.rand(k, generator=generator) * 4 + 0.1
    return (torch.randn(rows, k // 4, generator=generator) @ mixing) * sizes


def test_gptq_equals_round_to_nearest_where_the_inputs_are_uncorrelated():
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    hessian = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(2)) + 0.5)
    for found, expected in zip(gptq_int4(weight, hessian, 64), quantize_int4_groups(weight, 64)):
        assert torch.equal(found, expected)


def test_gptq_moves_rounding_errors_where_the_outputs_lose_least():
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    x = correlated_inputs(512, 256)
    values, scales, zeros = gptq_int4(weight, x.T @ x, 64)
    rtn_values, rtn_scales, rtn_zeros = quantize_int4_groups(weight, 64)
    assert torch.equal(scales, rtn_scales) and torch.equal(zeros, rtn_zeros)  # the same grid, other points on it
    assert values.dtype == torch.uint8 and int(values.max()) <= 15
    assert not torch.equal(values, rtn_values)
    error = ((x @ (weight - dequantized(values, scales, zeros, 64)).T) ** 2).sum()
    rtn_error = ((x @ (weight - dequantized(rtn_values, rtn_scales, rtn_zeros, 64)).T) ** 2).sum()
    assert error < 0.5 * rtn_error, (error, rtn_error)


def test_an_input_that_is_always_zero_leaves_the_rest_finite():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    x = correlated_inputs(128, 64)
    x[:, 5] = 0
    values, scales, zeros = gptq_int4(weight, x.T @ x, 32)
    assert torch.isfinite(dequantized(values, scales, zeros, 32)).all()


def test_calibration_text_is_the_models_own_seeded_and_leaves_the_global_rng_alone():
    model = tiny_llama(seed=5)
    state = torch.random.get_rng_state()
    ids = self_generated_ids(model, num_sequences=3, length=20)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert ids.shape == (3, 20) and torch.equal(ids, self_generated_ids(model, num_sequences=3, length=20))
    assert not torch.equal(ids, self_generated_ids(model, num_sequences=3, length=20, seed=1))


def _logit_error(model, reference_logits, prompts) -> float:
    with torch.no_grad():
        return float(((model(input_ids=prompts).logits - reference_logits) ** 2).mean())


def test_a_gptq_model_is_closer_to_the_float_model_than_round_to_nearest(monkeypatch):
    prompts = self_generated_ids(tiny_llama(seed=6, dtype=torch.float64), num_sequences=4, length=64, seed=9)
    with torch.no_grad():
        reference_logits = tiny_llama(seed=6, dtype=torch.float64)(input_ids=prompts).logits
    rtn, found = tiny_llama(seed=6, dtype=torch.float64), tiny_llama(seed=6, dtype=torch.float64)
    assert quantize_model(rtn, "w4a16") == quantize_model(found, "w4a16_gptq") == 14
    assert all(type(m) is Int4Linear for n, m in found.named_modules() if n.endswith("proj"))
    assert type(found.lm_head) is torch.nn.Linear
    assert _logit_error(found, reference_logits, prompts) < 0.8 * _logit_error(rtn, reference_logits, prompts)
    # the Hessians taken a few linears a pass (a large model) give the same weights as all in one pass
    monkeypatch.setattr(gptq, "HESSIAN_BYTES", 4 * 64 * 64)
    again = tiny_llama(seed=6, dtype=torch.float64)
    quantize_model(again, "w4a16_gptq")
    for (name, a), (_, b) in zip(found.named_buffers(), again.named_buffers()):
        assert torch.equal(a, b), name
