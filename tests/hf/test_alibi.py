"""BLOOM and MPT (ALiBi: a per-head slope times each key's distance in the scores, computed by their own inline
attention code) against HF's greedy tokens and top-5 logprobs, with chunked prefill, preemption and `n = 2`:
each prompt chunk and decode sees its keys' distances from its own position."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from architectures import MAX_NEW_TOKENS, TOP_LOGPROBS, build, compare, hf_oracle, prompts_for

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import TorchKernel


@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_alibi_models_equal_hf_under_pressure(model_type):
    model = build(model_type, torch.float64)
    prompts = prompts_for(model)
    expected = hf_oracle(model, prompts)
    engine = paged_hf.wrap(model, num_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4).generator
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
