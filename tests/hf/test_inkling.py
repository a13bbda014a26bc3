"""Inkling and Inkling 2 with their position terms made loud: the learned bias by distance and the per-token sinks
of a random tiny model are far below what tokens notice (weights of std 0.02), so here they are scaled up until
dropping either, or the log scaling by position, changes the answer. The engine must still give HF's greedy tokens
and top-5 logprobs with chunked prefill, preemption and the loop's second pass (its own cache layers)."""

from __future__ import annotations

import pytest
import torch
from architectures import build, compare, hf_oracle, prompts_for

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import TorchKernel

#: model_type -> dtype (Inkling 2's own generate fails in float64)
MODELS = {"inkling_text": torch.float64, "inkling2_text": torch.float32, "inkling2_loop_text": torch.float32}


def loud(model_type: str) -> torch.nn.Module:
    model = build(model_type, MODELS[model_type])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("rel_logits_proj.proj", "relative_position_bias.proj")):
                parameter.mul_(200.0)  # std 4: logits of several units per distance
            elif name.endswith("sink_proj.weight"):
                parameter.mul_(100.0)
    return model


@pytest.mark.parametrize("model_type", MODELS)
def test_loud_position_terms_equal_hf(model_type):
    model = loud(model_type)
    prompts = prompts_for(model)
    expected = hf_oracle(model, prompts)
    engine = paged_hf.wrap(model, num_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4).generator
    assert isinstance(engine.runner.kernel, TorchKernel)  # the compiled kernels have no bias by distance
    params = SamplingParams(max_new_tokens=len(expected[0][0]), temperature=0, ignore_eos=True, logprobs=5)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats()["num_preemptions"] > 0
    assert compare(prompts, expected, outputs) is None
