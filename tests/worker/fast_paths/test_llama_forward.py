"""Llama's forward without transformers' wrappers (paged_hf.worker.fast_paths.llama_forward): each step's logits
are the model's own forward's bit for bit (prompt steps, decode steps whose stack is one compiled call), the
tokens transformers' own; a hook on either module or a global one, or a forward that is not Llama's, turns it off."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama
from conftest import VOCAB, compare_each_step_both_ways, hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import small_gemm


def _llama(dtype, layers: int = 3) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512)
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # norms other than ones: the final norm left out or applied twice would show
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.rand(parameter.shape) + 0.5)
    return model


def _engine(model):
    return paged_hf.wrap(model, num_blocks=64, max_num_batched_tokens=32).generator


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_step_gives_the_models_own_forward_bits(dtype):
    """Prompt chunks (every layer called) and decode steps (the stack in one call at the first layer, the later
    layers skipped) through this forward and through the model's own give the same logits bit for bit."""
    engine = _engine(_llama(dtype))
    runner = engine.runner
    native = runner.fused_layers.lean.native
    served = compare_each_step_both_ways(engine, runner.llama_forward, "enabled", "steps_served")
    stacks_before = native.stacks_served
    prompts = random_prompts([5, 40, 11], seed=3)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
                              use_tqdm=False)
    assert len(served) >= 9 and set(served) == {1}
    assert native.stacks_served - stacks_before >= 8 or not small_gemm.functions().get(dtype)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]


def test_tokens_are_transformers_and_hooks_turn_it_off():
    """float32 against the oracle through this forward; a hook on the decoder, a pre-hook on the model or a global
    forward hook runs (each step: the model's own forward), and the tokens stay transformers'."""
    model = _llama(torch.float32)
    engine = _engine(model)
    forward = engine.runner.llama_forward
    prompts = random_prompts([7, 30], seed=5)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    expected = [hf_greedy(model, p, 10) for p in prompts]
    before = forward.steps_served
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)] == expected
    assert forward.steps_served - before >= 10
    seen = []
    for hook in (lambda: model.model.register_forward_hook(lambda *args: seen.append(1)),
                 lambda: model.register_forward_pre_hook(lambda *args: seen.append(1)),
                 lambda: torch.nn.modules.module.register_module_forward_hook(
                     lambda module, *args: seen.append(1) if module is model else None)):
        handle, before = hook(), forward.steps_served
        seen.clear()
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)] == expected
        handle.remove()
        assert forward.steps_served == before and len(seen) >= 10


def test_the_modeling_files_functions_are_read_at_each_call(monkeypatch):
    """A patch of `create_causal_mask` in Llama's modeling file after the engine was built is called, as the
    model's own forward would call it."""
    model = _llama(torch.float32)
    engine = _engine(model)
    calls = []
    original = modeling_llama.create_causal_mask
    monkeypatch.setattr(modeling_llama, "create_causal_mask", lambda **kwargs: calls.append(1) or original(**kwargs))
    before = engine.runner.llama_forward.steps_served
    prompt = random_prompts([6], seed=1)[0]
    tokens = engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0), use_tqdm=False)
    served = engine.runner.llama_forward.steps_served - before
    assert served >= 4 and len(calls) >= served
    monkeypatch.undo()
    assert tokens[0].outputs[0].token_ids == hf_greedy(model, prompt, 4)


def test_models_whose_forward_is_not_llamas_have_none():
    """Qwen2's decoder forward (sliding-window masks) and a subclass with a forward of its own are not recognised;
    the engine runs their own forwards."""

    class Scaled(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits * 2
            return output

    scaled = Scaled(_llama(torch.float32).config).eval()
    for model in (tiny_model("qwen2", dtype=torch.float32), scaled):
        assert _engine(model).runner.llama_forward is None
    assert _engine(_llama(torch.float32)).runner.llama_forward is not None
