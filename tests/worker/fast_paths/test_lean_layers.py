"""The lean decoder layers (paged_hf.worker.fast_paths.lean_layers): a step of decodes through them gives the
logits of the stand-ins' path bit for bit, in bf16 and float32; steps and layers they do not serve go that way."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import VOCAB, compare_each_step_both_ways, hf_greedy, make_adapter, random_prompts, tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import quant_gemm, small_gemm
from paged_hf.loader.quantized import quantize_model


def _engine(model, **options):
    return paged_hf.wrap(_random_norms(model), num_blocks=64, max_num_batched_tokens=32, **options).generator


def _random_norms(model):
    """Norm weights other than ones (a random model's are all ones: a norm applied with another's weight would not
    show); the same each time."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_steps_give_the_stand_ins_bits(dtype):
    """head_dim 16: the decode kernel serves prompt chunks too (its tiles; the bf16 prefill kernel takes 64)."""
    engine = _engine(tiny_model("llama", dtype=dtype))
    served = compare_each_step_both_ways(engine)
    prompts = random_prompts([5, 23, 40], seed=4)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0), use_tqdm=False)
    assert len(served) >= 8 and set(served) == {2}  # both layers of every step
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_layer_in_one_compiled_call_gives_the_lean_calls_bits(dtype):
    """Decode steps of one and two requests (the few-row loops' rows): each layer in one compiled call
    (native_layer.py) gives the logits of the lean path's dozen calls bit for bit; the prompt steps go the lean way."""
    if not small_gemm.functions().get(dtype):
        pytest.skip("no few-row loops on this CPU")
    engine = _engine(tiny_model("llama", dtype=dtype))
    served = compare_each_step_both_ways(engine, engine.runner.fused_layers.lean.native)
    prompts = random_prompts([5, 11], seed=9)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
                              use_tqdm=False)
    assert served[0] == 0 and served.count(2) >= 6  # the prompts' step its own way; then both layers each step
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]


def _llama(dtype, layers: int, **extra):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, **extra)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layers", [1, 2, 5])
def test_the_decoder_stack_in_one_compiled_call_gives_one_call_per_layers_bits(dtype, layers):
    """Decode steps of one and two requests: the whole stack in one call (its layers' outputs in two buffers in
    turn, the last one's out) gives the logits of one compiled call per layer bit for bit; each later layer hands
    the stack's output on."""
    if not small_gemm.functions().get(dtype):
        pytest.skip("no few-row loops on this CPU")
    engine = _engine(_llama(dtype, layers))
    stacks = compare_each_step_both_ways(engine, engine.runner.fused_layers.lean.native, "stacks_enabled",
                                          "stacks_served")
    prompts = random_prompts([5, 11], seed=9)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
                              use_tqdm=False)
    assert stacks[0] == 0 and stacks.count(1) >= 6  # the prompts' step its own way; then one call a step
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]


def test_the_decoder_stack_gives_transformers_tokens_and_steps_aside_for_hooks():
    """float32 against the oracle with the stack in one call; a decoder layer with a hook (which would see its own
    output) makes every layer go its own way, and the tokens are the same."""
    model = _llama(torch.float32, 3)
    engine = _engine(model)
    native = engine.runner.fused_layers.lean.native
    prompts = random_prompts([7, 30], seed=5)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    expected = [hf_greedy(model, p, 10) for p in prompts]
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)] == expected
    assert native.stacks_served >= 8 or not small_gemm.functions().get(torch.float32)
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(output))
    before = native.stacks_served
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)] == expected
    handle.remove()
    assert native.stacks_served == before and len(seen) >= 10


@pytest.mark.skipif(not small_gemm.functions().get(torch.float32), reason="no few-row loops on this CPU")
def test_the_stack_plan_is_kept_while_the_model_is_as_it_was_and_made_again_when_not():
    """One plan serves every decode step of a generation; a weight replaced, a weight changed in place, a norm
    replaced or an attention flag switched between generations makes it again, and the tokens are HF's on the
    model as it is then (float32)."""
    model = _llama(torch.float32, 3)
    engine = _engine(model)
    native = engine.runner.fused_layers.lean.native
    prompt = random_prompts([9], seed=2)[0]
    params = SamplingParams(max_new_tokens=8, temperature=0)

    def generate_and_count():
        made, served = native.stack_plans_made, native.stacks_served
        tokens = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert tokens == hf_greedy(model, prompt, 8)
        return native.stack_plans_made - made, native.stacks_served - served

    made, served = generate_and_count()  # made at the first decode step (or by the engine probe's), kept after
    assert made <= 1 and served == 7
    assert generate_and_count() == (0, 7)  # nothing changed: still the same plan
    layers = model.model.layers
    with torch.no_grad():
        layers[2].mlp.down_proj.weight = torch.nn.Parameter(torch.randn_like(layers[2].mlp.down_proj.weight) * 0.05)
    assert generate_and_count() == (1, 7)
    with torch.no_grad():
        layers[1].self_attn.k_proj.weight.mul_(-1.5)
    assert generate_and_count() == (1, 7)
    with torch.no_grad():
        layers[0].post_attention_layernorm.weight = torch.nn.Parameter(torch.rand(64) + 0.5)
    assert generate_and_count() == (1, 7)
    layers[1].self_attn.scaling = layers[1].self_attn.scaling * 0.5
    assert generate_and_count() == (1, 7)


def test_weights_given_other_data_in_place_of_theirs_are_read_at_the_next_step():
    """`parameter.data = other` (what `Module.to()` does to parameters, and weight-loading code) keeps the tensor
    and its version count: the stack's kept plan, its layers' structs, the few-row loops' pointers and the
    oneDNN-packed copies notice the new address, and the tokens are HF's on the new weights (float32; one
    sequence: the stack in one call; nine: the packed copies); biases alike (those of q/k/v and the MLP here)."""
    model = _random_norms(_llama(torch.float32, 3, attention_bias=True, mlp_bias=True))
    engine = _engine(model)
    prompts = random_prompts([9, 5, 12, 7, 3, 8, 10, 6, 4], seed=2)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)

    def assert_transformers_tokens():
        for batch in (prompts[:1], prompts):
            outputs = engine.generate(batch, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 6) for p in batch]

    assert_transformers_tokens()
    layers = model.model.layers
    for module, name in ((layers[1].self_attn.k_proj, "weight"), (layers[2].self_attn.o_proj, "weight"),
                         (layers[0].mlp.down_proj, "weight"), (layers[1].post_attention_layernorm, "weight"),
                         (model.model.norm, "weight"), (model.lm_head, "weight"), (layers[0].self_attn.v_proj, "bias"),
                         (layers[2].mlp.up_proj, "bias"), (layers[1].mlp.down_proj, "bias")):
        tensor = getattr(module, name)
        with torch.no_grad():
            tensor.data = tensor + torch.randn_like(tensor) * 0.2  # new storage, the same tensor
        assert_transformers_tokens()


@pytest.mark.parametrize("quantization", ["int8", "w4a16", "w4a8"])
def test_quantized_projections_run_lean_with_the_stand_ins_bits(quantization):
    """q/k/v and gate/up as one stacked quantized linear, o_proj and down_proj quantized: the same calls either
    way (bf16 activations, W8A8, W4A16 and W4A8 kernels; their decode steps as compiled layers, W4A16's where the
    CPU has AVX512-BF16: its bf16 kernel)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    engine = _engine(model, quantization=quantization)
    groups = _projection_groups(engine)
    assert len(groups) == 4 and all(group.quantized for group in groups)
    # the compiled layer's decode steps against the lean path's calls (W4A16 without AVX512-BF16: the lean path's
    # against the stand-ins')
    compiled = quantization != "w4a16" or quant_gemm.bf16_activations()
    served = compare_each_step_both_ways(engine, engine.runner.fused_layers.lean.native if compiled else None)
    engine.generate(random_prompts([6, 20], seed=8), SamplingParams(max_new_tokens=6, temperature=0), use_tqdm=False)
    assert served[-1] == 2 and sum(served) >= 2 * 5
    # decode steps of 5 requests: past a float layer's few-row loops (2 rows in bf16), within the W8A8 and W4A8
    # kernels' 8, so compiled there too
    served.clear()
    engine.generate(random_prompts([6, 20, 3, 9, 14], seed=9), SamplingParams(max_new_tokens=6, temperature=0),
                    use_tqdm=False)
    assert served[-1] == 2 and served.count(2) >= 5
    # an o_proj's and a down_proj's weights given other data (`.data =`: the same tensor, its data elsewhere): the
    # compiled layer reads the new data, as the lean path's calls do
    served.clear()
    layers = model.model.layers
    for linear in (layers[0].self_attn.o_proj, layers[1].mlp.down_proj):
        linear.qweight.data = linear.qweight.flip(0).clone()
    engine.generate(random_prompts([6, 20], seed=10), SamplingParams(max_new_tokens=6, temperature=0), use_tqdm=False)
    assert served[-1] == 2


def test_a_layer_is_compiled_up_to_the_fewest_rows_its_linears_take():
    """W8A8 q/k/v and MLP with a float o_proj (`small_gemm.max_rows`: 2-4 rows in bf16): steps of 2 decodes
    compiled, of one more than the float loops take not (the W8A8 kernels alone would take up to 8), the same bits
    either way."""
    few = small_gemm.max_rows(torch.bfloat16)
    if not few:
        pytest.skip("no few-row loops on this CPU")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    float_o = [layer.self_attn.o_proj for layer in model.model.layers]
    quantize_model(model, "int8")
    for layer, o_proj in zip(model.model.layers, float_o):
        layer.self_attn.o_proj = o_proj
    engine = _engine(model)
    sequences = []
    served = compare_each_step_both_ways(engine, engine.runner.fused_layers.lean.native, sequences=sequences)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    engine.generate(random_prompts([6, 20], seed=8), params, use_tqdm=False)
    assert served[-1] == 2
    served.clear(), sequences.clear()
    engine.generate(random_prompts([6, 20, 9, 14, 3, 11][:few + 1], seed=8), params, use_tqdm=False)
    past = [count for count, rows in zip(served, sequences) if rows > few]
    assert len(past) >= 3 and set(past) == {0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_steps_up_to_the_few_row_loops_rows_are_compiled_and_past_them_not(dtype):
    """A float layer is compiled at as many decodes as its few-row loops take (`small_gemm.max_rows`), and at one
    more it goes the lean path's calls; the same bits either way."""
    few = small_gemm.max_rows(dtype)
    if not few:
        pytest.skip("no few-row loops on this CPU")
    engine = _engine(tiny_model("llama", dtype=dtype))
    sequences = []
    served = compare_each_step_both_ways(engine, engine.runner.fused_layers.lean.native, sequences=sequences)
    prompts = random_prompts([5, 8, 11, 3, 9, 6, 4, 7, 10], seed=4)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    engine.generate(prompts[:few], params, use_tqdm=False)
    assert served[-1] == 2 and [count for count, rows in zip(served, sequences) if rows == few].count(2) >= 3
    served.clear(), sequences.clear()
    engine.generate(prompts[:few + 1], params, use_tqdm=False)
    past = [count for count, rows in zip(served, sequences) if rows > few]
    assert len(past) >= 3 and set(past) == {0}


def _projection_groups(engine):
    layers = [site[3] for site in engine.runner.fused_layers.sites]
    return [layer.parts[name].group for layer in layers if hasattr(layer, "parts") for name in ("self_attn", "mlp")]


def test_prompt_chunks_of_the_prefill_kernel_go_the_stand_ins_way():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    engine = _engine(model)
    if engine.runner.kernel.prefill_isa is None:
        pytest.skip("no AVX512-BF16 here: bf16 prompt chunks go to the decode kernel, which the lean path serves")
    served = compare_each_step_both_ways(engine)
    engine.generate(random_prompts([5, 45], seed=3), SamplingParams(max_new_tokens=6, temperature=0), use_tqdm=False)
    assert served[0] == 0 and served[-1] == 2 and set(served) == {0, 2}


def test_decode_steps_give_transformers_tokens():
    """float32 against the oracle; the lean path served the decode steps."""
    model = tiny_model("llama", dtype=torch.float32)
    engine = _engine(model)
    prompts = random_prompts([7, 30], seed=5)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0), use_tqdm=False)
    assert engine.runner.fused_layers.lean.layers_served >= 2 * 8
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 10) for p in prompts]


def test_hooked_modules_run_as_hooked():
    """A layer whose o_proj carries a hook still runs lean (its module is called, hooks and all); one whose k_proj
    is hooked (so it is not fused) runs its own forward."""
    model = tiny_model("llama", dtype=torch.float32)
    calls = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *args: calls.append(1))
    model.model.layers[1].self_attn.k_proj.register_forward_pre_hook(lambda *args: None)
    engine = _engine(model)
    served = compare_each_step_both_ways(engine)
    calls.clear()  # (the engine probe's forwards)
    prompt = random_prompts([9], seed=6)[0]
    output = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0), use_tqdm=False)[0]
    assert set(served) == {1}  # layer 0 lean in every step, layer 1 (k_proj hooked) its own way
    assert len(calls) == 2 * len(served)  # the hook ran in every forward, lean or not
    assert output.outputs[0].token_ids == hf_greedy(model, prompt, 6)


def test_adapter_steps_run_lean_with_the_stand_ins_bits(tmp_path):
    """LoRA adapters on q/k/v and the MLP, mixed with the base model in one batch: once the engine knows the
    adapters' groups, their decode steps run lean, bit for bit the stand-ins' way, each output peft's alone."""
    base = _random_norms(tiny_model("llama", dtype=torch.float32))
    configs = {"qkv": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
               "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])}
    oracles = {name: make_adapter(base, tmp_path / name, seed, **config)
               for seed, (name, config) in enumerate(configs.items(), start=3)}
    engine = _engine(base, adapters={name: str(tmp_path / name) for name in configs})
    served = compare_each_step_both_ways(engine)
    prompts, adapters = random_prompts([6, 13, 9], seed=8), ["qkv", None, "mlp"]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0), adapters=adapters,
                              use_tqdm=False)
    assert served[-1] == 2
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(base if a is None else oracles[a], p, 6) for p, a in zip(prompts, adapters)]
