"""Every hybrid or recurrent architecture transformers ships, under the scheduler's pressure.

tests/hf/test_architectures.py compares each architecture with HF with chunked prefill; here each hybrid one
(linear-attention, SSM or convolution layers: `architectures.is_hybrid`) meets the same oracle (HF's greedy
tokens, one prompt at a time, and its top-5 logprobs within 1e-3) with preemption forced (too few blocks for the
batch: a preempted request recomputes its state), `n = 2` (each child forks its parent's state) and chunked
prefill, then an aborted request: no state slot or block is left taken. float64 (float32 where HF's own generate
fails in float64). The few the engine does not serve are refused at `wrap()`, each for the reason named below.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from architectures import (MAX_NEW_TOKENS, TOP_LOGPROBS, OracleDisagrees, architectures, build, compare, hf_oracle,
                           is_hybrid, not_a_decoder, prompts_for, quiet)
from test_hybrid_models import assert_no_state_leak

import paged_hf
from paged_hf import SamplingParams

HYBRIDS = [name for name in architectures() if is_hybrid(name) and not not_a_decoder(name)]

#: refused at wrap(): why (the refusal's text, matched)
NOT_SERVED = {
}
PRESSURE = {"num_blocks": 12, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 4}


def model_and_oracle(model_type: str):
    """The tiny model and HF's answer, in float64, else float32 (HF's own generate fails in float64 for some)."""
    failure = None
    for dtype in (torch.float64, torch.float32):
        with quiet():
            try:
                model = build(model_type, dtype)
                prompts = prompts_for(model)
                return model, prompts, hf_oracle(model, prompts)
            except OracleDisagrees as exc:
                failure = exc
            except Exception as exc:  # noqa: BLE001 - HF's own failure in this dtype
                failure = exc
    pytest.skip(f"HF's own generate has no answer for {model_type}: {failure}")


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrid_equals_hf_under_preemption_and_n_2(model_type):
    model, prompts, expected = model_and_oracle(model_type)
    if model_type in NOT_SERVED:
        with pytest.raises((ValueError, NotImplementedError), match=NOT_SERVED[model_type]):
            paged_hf.wrap(model, **PRESSURE)
        return
    engine = paged_hf.wrap(model, **PRESSURE).generator
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_LOGPROBS,
                            n=2)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats()["num_preemptions"] > 0, model_type
    for child in range(2):  # each child alone, as the oracle's single answer
        as_first = [dataclasses.replace(output, outputs=[output.outputs[child]]) for output in outputs]
        assert compare(prompts, expected, as_first) is None, (model_type, child)
    assert_no_state_leak(engine)
    request_id = engine.add_request(prompts[0], params)
    engine.step()
    engine.abort(request_id)
    engine.step()
    assert_no_state_leak(engine)


def test_the_sweep_names_every_refusal():
    assert set(NOT_SERVED) <= set(HYBRIDS)
