"""oneDNN-packed linears (paged_hf.worker.fast_paths.packed_linears): swapped in for a step only, same results as
torch's linears."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import small_gemm
from paged_hf.kernels.small_gemm import SmallLinear
from paged_hf.worker.fast_paths.packed_linears import PackedLinear, PackedLinears, packable_dtypes

pytestmark = pytest.mark.skipif(torch.float32 not in packable_dtypes(), reason="this torch build has no oneDNN")


def test_the_model_is_untouched_outside_the_context_and_restored_after_an_error():
    model = tiny_model("llama", dtype=torch.float32)
    before = dict(model.named_modules())
    packed = PackedLinears(model)
    assert len(packed.sites) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    with pytest.raises(RuntimeError, match="boom"), packed:
        assert [type(parent._modules[name]) for parent, name, _, _ in packed.sites] == [PackedLinear] * 15
        assert type(model.model.layers[0].mlp.down_proj) is PackedLinear
        raise RuntimeError("boom")
    assert dict(model.named_modules()) == before


@pytest.mark.parametrize("dtype", packable_dtypes())
def test_packed_forward_matches_torch_linear(dtype):
    model = tiny_model("qwen2", dtype=dtype)  # qwen2: q/k/v carry biases
    ids = torch.tensor([random_prompts([37])[0]])
    with torch.inference_mode():
        expected = model(ids).logits
        with PackedLinears(model):
            got = model(ids).logits
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_a_weight_changed_in_place_is_packed_again():
    linear = torch.nn.Linear(16, 8)
    packed = PackedLinear(linear)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x))
    with torch.no_grad():
        linear.weight.mul_(-2.0)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x))
    linear.weight = torch.nn.Parameter(torch.randn(8, 16))  # replaced, not changed in place
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x))


def test_float64_models_are_not_packed_and_the_option_turns_packing_off():
    assert PackedLinears(tiny_model("llama")).sites == []  # oneDNN has no float64 matmul
    model = tiny_model("llama", dtype=torch.float32)
    assert paged_hf.wrap(model, num_blocks=16, pack_linear_weights=False).generator.runner.packed_linears.__class__ \
        is not PackedLinears


def test_engine_with_packed_linears_gives_the_unpacked_engines_tokens():
    """float32 argmax over a 128-token vocabulary: both engines' greedy tokens agree (a reordered sum moves
    logits by ~1e-6, far below the gaps between this model's top tokens)."""
    model = tiny_model("llama", dtype=torch.float32)
    prompts = random_prompts([5, 23, 40])
    params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=1)
    runs = {}
    for pack in (True, False):
        engine = paged_hf.wrap(model, num_blocks=32, max_num_batched_tokens=16, pack_linear_weights=pack).generator
        assert (type(engine.runner.packed_linears) is PackedLinears) == pack
        runs[pack] = [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    for packed, plain in zip(runs[True], runs[False]):
        assert packed.token_ids == plain.token_ids
        for a, b in zip(packed.logprobs, plain.logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert abs(a[token] - b[token]) < 1e-4


def test_a_model_created_under_inference_mode_is_served():
    """Its weights are inference tensors, which have no version counter to watch (this raised before)."""
    with torch.inference_mode():
        model = tiny_model("llama", dtype=torch.float32)
    prompts = random_prompts([6, 19])
    params = SamplingParams(max_new_tokens=5, temperature=0)
    runs = [[o.outputs[0].token_ids for o in paged_hf.wrap(model, num_blocks=16, pack_linear_weights=pack)
             .generator.generate(prompts, params, use_tqdm=False)] for pack in (True, False)]
    assert runs[0] == runs[1]


@pytest.mark.skipif(not small_gemm.functions(), reason="the few-row loops need AVX-512 or AVX2")
def test_a_dtype_onednn_does_not_pack_takes_the_few_row_loops_and_torchs_linear_above():
    """bf16 on an AVX2 CPU (oneDNN packs no bf16 there): one row through the few-row loops, many through
    F.linear exactly as the model's own linear."""
    linear = torch.nn.Linear(64, 24, dtype=torch.bfloat16)
    stand_in = PackedLinear(linear, packs=False)
    calls = []
    original = SmallLinear.__call__
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(SmallLinear, "__call__", lambda self, rows: calls.append(len(rows)) or original(self, rows))
        torch.testing.assert_close(stand_in(x[:1]), linear(x[:1]), atol=2e-2, rtol=2e-2)
        assert torch.equal(stand_in(x), linear(x)) and stand_in.packed is None
    assert calls == [1]


def test_packed_copies_are_made_only_once_a_step_batches_past_the_few_row_loops():
    """One chat never holds the weights twice: its decodes take the few-row loops and its prompts the weights
    themselves; the first step of more sequences than those loops compute makes the packed copies (q/k/v and
    gate/up concatenated only then). Tokens are the unpacked engine's throughout."""
    model = tiny_model("llama", dtype=torch.float32)
    few = small_gemm.max_rows(torch.float32)
    prompts = random_prompts([5, 23, 40, 9, 17, 30, 12, 7, 26, 14][:few + 1])
    params = SamplingParams(max_new_tokens=6, temperature=0)
    engine = paged_hf.wrap(model, num_blocks=64).generator
    plain = paged_hf.wrap(model, num_blocks=64, pack_linear_weights=False).generator
    stand_ins = [stand_in for *_, stand_in in engine.runner.packed_linears.sites]
    groups = engine.runner.fused_layers.groups
    assert stand_ins and groups
    for count in ([few] if few else []) + [few + 1]:
        got = [o.outputs[0].token_ids for o in engine.generate(prompts[:count], params, use_tqdm=False)]
        assert got == [o.outputs[0].token_ids for o in plain.generate(prompts[:count], params, use_tqdm=False)]
        packed = count > few
        assert all((stand_in.packed is not None) == packed for stand_in in stand_ins), count
        assert all((group.packed is not None) == packed for group in groups), count
    for group in groups:  # the group reads the linears' own weights: no concatenated copy of its own
        assert [w.data_ptr() for w in group.weights] == [lin.weight.data_ptr() for lin in group.linears]
