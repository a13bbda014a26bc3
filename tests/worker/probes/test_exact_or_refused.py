"""Exact or refused (paged_hf.worker.probes.model_probe, engine_probe, PagedCache's step books): a model whose attention
the engine cannot compute as the model defines it is refused at wrap() naming why; a module the user patches or
hooks after wrap() runs as patched inside the engine's steps; a layer that stops reaching the paged attention
fails the step (its requests aborted, no block leaked) instead of returning other tokens."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import assert_no_leak, hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import SamplingParams, UnsupportedModelError
from paged_hf.integrations.transformers import UnservedAttention

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


def _engine_tokens(model, prompts, **config):
    engine = paged_hf.wrap(model, num_blocks=64, block_size=4, max_num_batched_tokens=16, **config).generator
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)], engine


def _attention_with_own_code(attention, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                             **kwargs):
    """LlamaAttention's math without transformers' attention interface (as Falcon or GPT-Neo compute)."""
    shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
    query, key, value = (getattr(attention, n)(hidden_states).view(shape).transpose(1, 2)
                         for n in ("q_proj", "k_proj", "v_proj"))
    query, key = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(query, key, *position_embeddings)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx)
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1)
    return attention.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


def test_attention_with_its_own_code_is_refused_at_wrap_naming_why():
    model = tiny_model("llama")
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.forward = _attention_with_own_code.__get__(attention)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*no attention call read"):
        paged_hf.wrap(model, num_blocks=64)


def test_attention_that_changes_k_v_after_caching_is_refused():
    model = tiny_model("llama")
    original = transformers.AttentionInterface._global_mapping["sdpa"]

    def halved_values(module, query, key, value, *args, **kwargs):
        return original(module, query, key, value * 0.5, *args, **kwargs)

    transformers.AttentionInterface.register("halved", halved_values)
    model.config._attn_implementation = "halved"  # the model's own forward halves V: the engine cannot
    with pytest.raises(UnsupportedModelError, match="differ from the model's own forward"):
        paged_hf.wrap(model, num_blocks=64)


def test_a_module_patched_or_hooked_after_wrap_runs_as_patched():
    """The fused MLP and RMSNorm stand-ins must not bypass what the user put on the module."""
    model = tiny_model("llama", dtype=torch.float32)
    engine = paged_hf.wrap(model, num_blocks=64, block_size=4).generator
    prompts = random_prompts([5, 11])
    mlp = model.model.layers[0].mlp
    mlp_forward = type(mlp).forward
    mlp.forward = lambda x: 3.0 * mlp_forward(mlp, x)  # an instance forward
    hook = model.model.layers[1].post_attention_layernorm.register_forward_hook(lambda m, i, o: o * -1.0)
    try:
        expected = [hf_greedy(model, p, 6) for p in prompts]
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        hook.remove()
        del mlp.forward
    unpatched = [hf_greedy(model, p, 6) for p in prompts]
    assert got == expected != unpatched  # the patches change the tokens, and the engine ran them


def test_a_layer_that_stops_reaching_the_paged_attention_fails_the_step_not_the_tokens():
    model = tiny_model("llama")
    engine = paged_hf.wrap(model, num_blocks=64, block_size=4).generator
    attention = model.model.layers[1].self_attn
    attention.forward = _attention_with_own_code.__get__(attention)
    with pytest.raises(UnservedAttention, match=r"layers \[1\]"):
        engine.generate(random_prompts([5, 9]), GREEDY, use_tqdm=False)
    assert_no_leak(engine)
    del attention.forward  # the generator stays usable
    prompts = random_prompts([7])
    assert engine.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(model, prompts[0], 6)


def test_stand_ins_keep_the_face_the_model_reads():
    """A router reading `.weight.dtype` of a packed Linear, a norm's `variance_epsilon` (Hunyuan, Zaya)."""
    from paged_hf.worker.fast_paths.fused_layers import FusedLayers  # noqa: PLC0415
    from paged_hf.worker.fast_paths.packed_linears import PackedLinear  # noqa: PLC0415

    model = tiny_model("llama", dtype=torch.float32)
    linear = model.model.layers[0].self_attn.o_proj
    packed = PackedLinear(linear)
    assert packed.weight is linear.weight and packed.in_features == linear.in_features
    fused = FusedLayers(model)
    for _, _, original, stand_in in fused.sites:
        assert stand_in.training == original.training
        for name in ("weight", "variance_epsilon", "head_dim", "out_features"):
            if hasattr(original, name):
                assert getattr(stand_in, name) is getattr(original, name), (type(stand_in).__name__, name)


def test_a_quantized_cache_is_probed_on_a_cache_in_the_models_dtype():
    """int8 rounding is the kernels' tests' business; the probe checks the model (and allocates little)."""
    model = tiny_model("llama")
    prompts = random_prompts([6, 14])
    got, engine = _engine_tokens(model, prompts, kv_cache_dtype="int8")
    assert engine.runner.cache.key_cache[0].dtype == torch.int8
    assert len(got) == 2 and all(len(tokens) == 6 for tokens in got)
    assert_no_leak(engine)


@pytest.mark.parametrize("variant", [dict(new_decoder_architecture=True, num_kv_heads=2), dict(multi_query=False)])
def test_falcons_own_attention_code_is_served_through_the_paged_attention(variant):
    """Falcon computes attention inline; its stand-in (worker/families/falcon.py) routes it to the paged kernels."""
    config = transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       max_position_embeddings=256, **variant)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    prompts = random_prompts([5, 17])
    got, engine = _engine_tokens(model, prompts)
    assert got == [hf_greedy(model, p, 6) for p in prompts]
    assert_no_leak(engine)


def test_falcon_with_alibi_is_refused_naming_it():
    config = transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       alibi=True)
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        paged_hf.wrap(transformers.FalconForCausalLM(config).eval(), num_blocks=64)


def test_a_dropped_engine_lets_its_model_go():
    """The model probe's registration in transformers' global attention registry holds nothing of the model once
    it is done: a wrapped model the user drops is freed (it stayed alive until another model was probed)."""
    import gc
    import weakref

    model = tiny_model("llama", seed=3)
    paged = paged_hf.wrap(model, num_blocks=16, block_size=4)
    assert paged.generator.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    dropped = weakref.ref(model)
    del model, paged
    gc.collect()
    assert dropped() is None
