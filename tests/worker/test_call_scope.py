"""The steps of one generate() call (paged_hf.worker.call_scope): its later steps take the compiled stack's plan as
its first step checked it, unless code of the user's runs inside a step; steps the user can come between check it
in full, and every one gives transformers' tokens (float32)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.kernels import small_gemm

pytestmark = pytest.mark.skipif(not small_gemm.functions().get(torch.float32), reason="no few-row loops on this CPU")

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", dtype=torch.float32)


def _engine(model):
    return paged_hf.wrap(model, num_blocks=64, max_num_batched_tokens=32).generator


def _full_checks(engine) -> int:
    plan = engine.runner.lean.native.stack_plan
    return 0 if plan is None else plan.checks


def test_a_calls_later_steps_take_the_plan_its_first_step_checked(model):
    engine = _engine(model)
    native = engine.runner.lean.native
    prompt = random_prompts([9], seed=3)[0]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    expected = hf_greedy(model, prompt, NEW_TOKENS)
    for _ in range(2):
        checks, served = _full_checks(engine), native.stacks_served
        assert engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert native.stacks_served - served == NEW_TOKENS - 1  # every decode step ran the stack in one call
        assert _full_checks(engine) - checks <= 1  # at the call's first decode step (none where it made the plan)
    # step() by step(): the user may come between any two of them, so each one checks in full
    checks = _full_checks(engine)
    engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == expected
    assert _full_checks(engine) - checks == NEW_TOKENS - 1


def test_a_weight_replaced_by_a_hook_inside_a_call_is_read_at_the_next_step(model):
    """A forward hook (code of the user's inside each step) replaces a weight at the call's fourth forward: every
    step checks the plan, and the tokens are transformers' own with the same hook."""
    engine = _engine(model)
    down = model.model.layers[1].mlp.down_proj
    original = down.weight
    replacement = torch.nn.Parameter(torch.randn(original.shape, generator=torch.Generator().manual_seed(4)) * 0.5)
    prompt = random_prompts([9], seed=3)[0]
    calls = []

    def replace_at_the_fourth_forward(module, args, output):
        calls.append(1)
        if len(calls) == 4:
            down.weight = replacement

    unchanged = hf_greedy(model, prompt, NEW_TOKENS)
    handle = model.lm_head.register_forward_hook(replace_at_the_fourth_forward)
    try:
        native = engine.runner.lean.native
        first_plan, made = native.stack_plan, native.stack_plans_made
        checks = first_plan.checks
        tokens = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0),
                                 use_tqdm=False)[0].outputs[0].token_ids
        # every decode step checked the kept plan in full; the one after the replacement made it again
        assert native.stack_plans_made - made == 1
        assert first_plan.checks - checks + native.stack_plan.checks == NEW_TOKENS - 1
        down.weight = original
        calls.clear()
        expected = hf_greedy(model, prompt, NEW_TOKENS)
    finally:
        handle.remove()
        down.weight = original
    assert expected != unchanged  # (the replacement shows in the tokens)
    assert tokens == expected
