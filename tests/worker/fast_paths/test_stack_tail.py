"""The model's final norm and LM head computed in the decoder stack's compiled call
(paged_hf.worker.fast_paths.stack_tail): each decode step's logits are those of the forward's own norm and head
calls bit for bit (float32, bf16, a W8A8 head, several sequences), the float32 tokens transformers' own; a hook on
the head or on the final norm, or a patched `slice_logits_to_keep`, runs (the forward's own calls), and the
tokens are transformers' with it; a kept row the step does not have raises IndexError as torch's slice does."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama
from conftest import VOCAB, compare_each_step_both_ways, hf_greedy, random_prompts

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import small_gemm
from paged_hf.loader.quantized import quantize_model


def _llama(dtype) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # norms other than ones: the final norm left out, or its weight misread, would show
        model.model.norm.weight.copy_(torch.rand(config.hidden_size) + 0.5)
    return model


def _engine(model):
    return paged_hf.wrap(model, num_blocks=64, max_num_batched_tokens=32).generator


def _few_rows(dtype) -> int:
    few = small_gemm.max_rows(dtype)
    if not few:
        pytest.skip("no few-row loops on this CPU: no compiled stack")
    return few


@pytest.mark.parametrize("dtype, quantization", [(torch.float32, None), (torch.bfloat16, None),
                                                 (torch.bfloat16, "w4a8")])
def test_decode_steps_give_the_forwards_own_bits(dtype, quantization):
    """Each step through the stack's tail and through the forward's own norm and head: the same logits bit for
    bit; every decode step of one to three sequences is served by the tail (W4A8: its W8A8 head)."""
    few = _few_rows(dtype)
    model = _llama(dtype)
    if quantization:
        quantize_model(model, quantization)
    engine = _engine(model)
    sequences = []
    served = compare_each_step_both_ways(engine, engine.runner.llama_forward.tail, "enabled", "served", sequences)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    for count in sorted({1, min(3, few)}):
        served.clear(), sequences.clear()
        engine.generate(random_prompts([5, 17, 9][:count], seed=count), params, use_tqdm=False)
        decodes = [done for done, rows in zip(served, sequences) if rows == count][1:]  # (the first: a prompt's)
        assert len(decodes) >= 4 and set(decodes) == {1}, (served, sequences)


def test_float32_tokens_are_transformers():
    _few_rows(torch.float32)
    model = _llama(torch.float32)
    engine = _engine(model)
    tail = engine.runner.llama_forward.tail
    prompts = random_prompts([7, 30], seed=2)
    before = tail.served
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 10) for p in prompts]
    assert tail.served - before >= 9


def test_a_hook_on_the_head_or_the_final_norm_or_a_patched_slice_runs(monkeypatch):
    """Each of them leaves the norm and the head to the forward's own calls: the hook runs at every step, the
    stack is still one call, and the tokens are transformers' with the same hook (which changes them)."""
    _few_rows(torch.float32)
    model = _llama(torch.float32)
    engine = _engine(model)
    tail, native = engine.runner.llama_forward.tail, engine.runner.fused_layers.lean.native
    prompt = random_prompts([9], seed=6)[0]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    plain = hf_greedy(model, prompt, 8)
    seen = []
    hooks = (lambda: model.lm_head.register_forward_hook(lambda module, args, out: seen.append(1) or -out),
             lambda: model.model.norm.register_forward_hook(lambda module, args, out: seen.append(1) or out.flip(-1)))
    for hook in hooks:
        handle = hook()
        expected = hf_greedy(model, prompt, 8)
        seen.clear()
        served, stacks = tail.served, native.stacks_served
        tokens = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        handle.remove()
        assert expected != plain and tokens == expected
        assert tail.served == served and len(seen) >= 8 and native.stacks_served - stacks >= 7
    calls = []
    original = modeling_llama.slice_logits_to_keep
    monkeypatch.setattr(modeling_llama, "slice_logits_to_keep", lambda *args: calls.append(1) or original(*args))
    served = tail.served
    tokens = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == plain and tail.served == served and len(calls) >= 8


@pytest.mark.parametrize("tail_enabled", [True, False])
def test_a_kept_row_past_the_steps_rows_raises_as_the_forwards_own_slice_does(tail_enabled):
    """A decode step asked for the logits of a row it does not have: IndexError from the stack's tail as from
    torch's indexing in the forward's own calls, never another row's logits."""
    _few_rows(torch.float32)
    engine = _engine(_llama(torch.float32))
    runner = engine.runner
    runner.llama_forward.tail.enabled = tail_enabled
    call = runner._call_model

    def past_the_rows(kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            kwargs["logits_to_keep"] = torch.tensor([3])
        return call(kwargs)

    runner._call_model = past_the_rows
    raised_by = "out of range for a step of 1 rows" if tail_enabled else "out of bounds"  # (the tail's; torch's)
    with pytest.raises(IndexError, match=raised_by):
        engine.generate(random_prompts([6], seed=1), SamplingParams(max_new_tokens=4, temperature=0),
                        use_tqdm=False)
