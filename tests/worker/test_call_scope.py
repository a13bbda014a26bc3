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


@pytest.mark.parametrize("replaced", ["weight", "module"])
def test_what_a_hook_replaces_inside_a_call_is_read_at_the_next_step(model, replaced):
    """A forward hook (code of the user's inside each step) replaces a weight, or a whole linear, at the call's
    fourth forward: every step checks the plan and the swaps' sites, the tokens are transformers' own with the same
    hook, and the replacement is what the model holds after the call."""
    engine = _engine(model)
    mlp = model.model.layers[1].mlp
    original, original_weight = mlp.down_proj, mlp.down_proj.weight
    weight = torch.nn.Parameter(torch.randn(original_weight.shape, generator=torch.Generator().manual_seed(4)) * 0.5)
    linear = torch.nn.Linear(original.in_features, original.out_features, bias=False)
    linear.weight = weight
    prompt = random_prompts([9], seed=3)[0]
    calls = []

    def replace_at_the_fourth_forward(module, args, output):
        calls.append(1)
        if len(calls) == 4:
            if replaced == "weight":
                original.weight = weight  # (inside a step the model holds the engine's stand-ins at their places)
            else:
                mlp.down_proj = linear

    def restore():
        mlp.down_proj = original
        original.weight = original_weight
        calls.clear()

    unchanged = hf_greedy(model, prompt, NEW_TOKENS)
    handle = model.lm_head.register_forward_hook(replace_at_the_fourth_forward)
    try:
        native = engine.runner.lean.native
        first_plan, made = native.stack_plan, native.stack_plans_made
        checks = first_plan.checks
        tokens = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0),
                                 use_tqdm=False)[0].outputs[0].token_ids
        held = mlp.down_proj.weight
        # the decode steps up to the replacement checked the kept plan in full, and the one after it; a weight
        # replaced makes it again (a module of its own there leaves the layers to their own calls)
        assert first_plan.checks - checks == 4
        assert native.stack_plans_made - made == (replaced == "weight")
        restore()
        expected = hf_greedy(model, prompt, NEW_TOKENS)
    finally:
        handle.remove()
        restore()
    assert held is weight  # (the module the hook put there, or the weight it gave the linear)
    assert expected != unchanged  # (the replacement shows in the tokens)
    assert tokens == expected
