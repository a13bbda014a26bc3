"""Fused decoder-layer ops (paged_hf.worker.fast_paths.fused_layers): swapped in for a step only; the engine's
tokens equal plain transformers' in every family, and each stand-in is used exactly where the module runs Llama's
code."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.worker.fast_paths.fused_layers import FusedAttention, FusedLayers, FusedMLP, FusedRMSNorm, ProjectionSlice


def _kinds(fused: FusedLayers) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for _, _, _, stand_in in fused.sites:
        kinds[type(stand_in).__name__] = kinds.get(type(stand_in).__name__, 0) + 1
    return kinds


@pytest.mark.parametrize("family, expected", [
    ("llama", {"ProjectionSlice": 10, "FusedRMSNorm": 5, "FusedMLP": 2, "FusedAttention": 2, "FusedDecoderLayer": 2,
               "RotaryTable": 1}),
    ("qwen3", {"ProjectionSlice": 10, "FusedRMSNorm": 9, "FusedMLP": 2, "RotaryTable": 1}),  # q_norm/k_norm: its own
    ("gemma", {"ProjectionSlice": 10, "FusedAttention": 2, "RotaryTable": 1}),  # (1 + weight) RMSNorm, GELU MLP
    ("phi3", {"FusedRMSNorm": 5, "RotaryTable": 1}),  # qkv_proj and gate_up_proj: already one Linear each
])
def test_stand_ins_go_where_the_module_runs_llamas_code(family, expected):
    assert _kinds(FusedLayers(tiny_model(family, dtype=torch.float32))) == expected
    # float64, the reference dtype: HF's RMSNorm (float32 inside) is kept, and so the decoder layer's own forward;
    # the rest is fused
    unfused = ("FusedRMSNorm", "FusedDecoderLayer")
    assert _kinds(FusedLayers(tiny_model(family))) == {k: v for k, v in expected.items() if k not in unfused}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma"])
def test_engine_tokens_equal_transformers_with_the_fused_layers(family):
    """float64 (no argmax ties): qwen2's q/k/v carry biases, qwen3 norms q/k per head on the fused output."""
    model = tiny_model(family)
    prompts = random_prompts([3, 17, 40], seed=1)
    engine = paged_hf.wrap(model, num_blocks=32, max_num_batched_tokens=24).generator
    assert isinstance(engine.runner.fused_layers, FusedLayers)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 10) for p in prompts]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_forward_matches_the_models_own(dtype, family):
    model = tiny_model(family, dtype=dtype)
    ids = torch.tensor([random_prompts([29])[0]])
    with torch.inference_mode():
        expected = model(ids).logits
        with FusedLayers(model):
            assert type(model.model.layers[0].mlp) is FusedMLP
            assert (type(model.model.norm) is FusedRMSNorm) == (dtype != torch.float64)
            got = model(ids).logits
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_the_model_is_untouched_outside_a_step_and_restored_after_an_error():
    model = tiny_model("llama", dtype=torch.float32)
    before = dict(model.named_modules())
    fused = FusedLayers(model)
    attention = model.model.layers[1].self_attn
    with pytest.raises(RuntimeError, match="boom"), fused:
        assert type(attention.k_proj) is ProjectionSlice and type(model.model.layers[1].self_attn) is FusedAttention
        raise RuntimeError("boom")
    assert dict(model.named_modules()) == before
    assert all(group._input is None for group in fused.groups)  # no activation held past the step


def test_a_projection_weight_changed_between_steps_is_used():
    model = tiny_model("llama")
    engine = paged_hf.wrap(model, num_blocks=32).generator
    prompt = random_prompts([11], seed=2)[0]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    assert engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(model, prompt, 6)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(-3.0)
        model.model.layers[1].mlp.up_proj.weight.mul_(2.0)
    assert engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(model, prompt, 6)


def test_a_projection_called_with_another_input_is_computed_for_it():
    """Siblings share one matmul only for the same input object; anything else is computed as asked."""
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    x, y = torch.randn(1, 5, 64, dtype=torch.float64), torch.randn(1, 5, 64, dtype=torch.float64)
    with torch.inference_mode():
        expected = attention.q_proj(x), attention.k_proj(y), attention.v_proj(x), attention.q_proj(x)
        with FusedLayers(model):
            got = attention.q_proj(x), attention.k_proj(y), attention.v_proj(x), attention.q_proj(x)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_hooked_modules_and_the_option_keep_the_models_own_forward():
    model = tiny_model("llama", dtype=torch.float32)
    model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda *args: None)
    # layer 0's MLP and attention keep their own forward, and so does its decoder layer; layer 1 is all fused
    assert _kinds(FusedLayers(model)) == {"ProjectionSlice": 7, "FusedRMSNorm": 5, "FusedMLP": 1, "FusedAttention": 1,
                                          "FusedDecoderLayer": 1, "RotaryTable": 1}
    runner = paged_hf.wrap(tiny_model("llama"), num_blocks=16, fuse_layers=False).generator.runner
    assert not isinstance(runner.fused_layers, FusedLayers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_engine_gives_the_unfused_engines_tokens(dtype):
    """Where every stand-in (the compiled RMSNorm too) is in use: greedy tokens as without them."""
    model = tiny_model("llama", dtype=dtype)
    prompts = random_prompts([5, 23, 40], seed=4)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    runs = {}
    for fuse in (True, False):
        engine = paged_hf.wrap(model, num_blocks=32, max_num_batched_tokens=16, fuse_layers=fuse).generator
        fused = engine.runner.fused_layers
        assert (isinstance(fused, FusedLayers) and _kinds(fused)["FusedRMSNorm"] == 5) == fuse
        runs[fuse] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert runs[True] == runs[False]
