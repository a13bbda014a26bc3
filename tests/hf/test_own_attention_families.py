"""Families whose attention is their own code, served by stand-ins (worker/families/), against HF's greedy
tokens and top-5 logprobs with chunked prefill, preemption and `n = 2`: Inkling and Inkling 2 (a learned bias by
query-key distance, per-token sinks, log scaling by position, the loop's second pass on cache layers of its own),
BLOOM and MPT (ALiBi), XGLM (BART's attention) and GIT (BERT's, inline). Random tiny models (weights of std 0.02)
leave these terms far below what tokens notice, so each model's are scaled up until dropping one, or getting a
scale, slope or position 10% wrong, changes the answer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from architectures import MAX_NEW_TOKENS, TOP_LOGPROBS, build, compare, hf_oracle, prompts_for

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels.torch_kernel import TorchKernel

INKLING2 = {"relative_position_bias.proj": 200.0, "sink_proj.weight": 100.0}
#: model_type -> (dtype: float32 where HF's own forward fails in float64, parameter name suffix -> scale)
MODELS = {
    "inkling_text": (torch.float64, {"rel_logits_proj.proj": 200.0}),  # std 4: logits of units per distance
    "inkling2_text": (torch.float32, INKLING2),
    "inkling2_loop_text": (torch.float32, INKLING2),
    "bloom": (torch.float64, {"query_key_value.weight": 8.0}),  # scores far from 0: a softmax far from uniform
    "mpt": (torch.float64, {"Wqkv.weight": 8.0}),
    "xglm": (torch.float32, {"q_proj.weight": 8.0, "k_proj.weight": 8.0}),
    "git": (torch.float64, {"self.query.weight": 8.0, "self.key.weight": 8.0}),  # as a text decoder
}


def scaled(model_type: str) -> torch.nn.Module:
    dtype, scales = MODELS[model_type]
    model = build(model_type, dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            for suffix, scale in scales.items():
                if name.endswith(suffix):
                    parameter.mul_(scale)
    return model


@pytest.mark.parametrize("model_type", MODELS)
def test_own_attention_families_equal_hf_under_pressure(model_type):
    model = scaled(model_type)
    prompts = prompts_for(model)
    expected = hf_oracle(model, prompts)
    engine = paged_hf.wrap(model, num_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4).generator
    assert engine.runner.family_stand_ins.sites
    if model_type not in ("xglm", "git"):  # the compiled kernels have no bias by distance, per-token sinks or ALiBi
        assert isinstance(engine.runner.kernel, TorchKernel)
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
