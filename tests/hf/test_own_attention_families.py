"""Families whose attention is their own inline code, served by stand-ins (worker/own_attention.py): BLOOM and MPT
(ALiBi: a per-head slope times each key's distance in the scores) and XGLM (BART's attention), against HF's greedy
tokens and top-5 logprobs, with chunked prefill, preemption and `n = 2`: each prompt chunk and decode sees its
keys' distances from its own position."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from architectures import MAX_NEW_TOKENS, TOP_LOGPROBS, build, compare, hf_oracle, prompts_for

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import TorchKernel


#: model_type -> dtype (HF's own XGLM fails in float64: its mask's minimum is a float32 scalar)
MODELS = {"bloom": torch.float64, "mpt": torch.float64, "xglm": torch.float32}


def sharp(model_type: str) -> torch.nn.Module:
    """The tiny model with its query and key projections scaled up: random weights of std 0.02 leave every score
    near 0 and the softmax near uniform, where a wrong scale, slope or position would hardly show."""
    model = build(model_type, MODELS[model_type])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "query_key_value.weight", "Wqkv.weight")):
                parameter.mul_(8.0)
    return model


@pytest.mark.parametrize("model_type", MODELS)
def test_own_attention_families_equal_hf_under_pressure(model_type):
    model = sharp(model_type)
    prompts = prompts_for(model)
    expected = hf_oracle(model, prompts)
    engine = paged_hf.wrap(model, num_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4).generator
    assert engine.runner.own_attentions.sites
    if model_type != "xglm":
        assert isinstance(engine.runner.kernel, TorchKernel)  # the compiled kernels have no ALiBi
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_LOGPROBS,
                            n=2)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats()["num_preemptions"] > 0
    for child in range(2):
        assert compare(prompts, expected, [dataclasses.replace(o, outputs=[o.outputs[child]]) for o in outputs]) is None
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


def test_bloom_outside_a_step_is_untouched():
    """The step's override of BLOOM's ALiBi tensor is gone after the step: a plain forward is HF's own."""
    model = build("bloom", torch.float64)
    input_ids = torch.tensor([prompts_for(model)[0]])
    expected = model(input_ids).logits
    engine = paged_hf.wrap(model, num_blocks=64, block_size=4).generator
    engine.generate([input_ids[0].tolist()], SamplingParams(max_new_tokens=2, temperature=0), use_tqdm=False)
    assert "build_alibi_tensor" not in model.transformer.__dict__
    assert torch.equal(model(input_ids).logits, expected)
