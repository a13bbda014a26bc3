"""Short steps while a request in a hurry waits for its first token (paged_hf.core.step_pacing): the step that
carries its first prefill gives no prefill chunk to what it holds back (decodes stay in), the steps after an
arrival cap that prefill to a quarter of the budget, and none of it happens under fcfs or among equals.

Driven through test_scheduling_policy's `Sim` (the scheduler alone, stepped as the engine steps it), then the engine
on a tiny float64 model against plain transformers."""

from __future__ import annotations

import pytest
from conftest import assert_no_leak, hf_greedy, random_prompts, tiny_model
from test_scheduling_policy import Sim, greedy

import paged_hf
from paged_hf import PagedConfig
from paged_hf.core.step_pacing import ARRIVAL_WINDOW_STEPS

BUDGET = 32
CAP = BUDGET // 4


def tenant_a_busy(policy: str, prompt_len: int, decode_len: int) -> Sim:
    """Tenant A (priority 0): one decoding request and three distinct long prompts, three steps in."""
    sim = Sim(policy, max_num_seqs=4, budget=BUDGET, num_blocks=256)
    sim.add("d0", prompt_len=6, max_new=decode_len, tenant="A")
    for i in range(3):
        sim.add(f"p{i}", prompt_len=prompt_len, max_new=4, tenant="A", token=10 + i)
    for _ in range(3):
        sim.step()
    return sim


def flood_then_urgent(policy: str):
    """A (priority 0) runs a decode and three long prompts (distinct, no prefix hits); after 3 steps B (priority
    -1 under `priority`, another tenant under `fair`) sends a short one. -> (sim, per-step schedules from B's
    arrival on: [(request id, tokens, whether a prefill chunk)], the requests that decoded at B's arrival)."""
    sim = tenant_a_busy(policy, prompt_len=160, decode_len=60)
    sim.add("B", prompt_len=6, max_new=2, priority=-1, tenant="B", token=9)
    steps, decoding = [], {r.request_id for r in sim.scheduler.running if r.num_tokens_to_compute == 1}
    for _ in range(ARRIVAL_WINDOW_STEPS + 4):
        prefilling = {r.request_id for r in [*sim.scheduler.running, *sim.scheduler.waiting]
                      if r.num_tokens_to_compute > 1}
        out = sim.step()
        steps.append([(s.request.request_id, s.num_new_tokens, s.request.request_id in prefilling)
                      for s in out.scheduled])
    return sim, steps, decoding


def a_prefill(step) -> int:
    return sum(n for rid, n, prefill in step if prefill and rid != "B")


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_the_first_prefill_of_a_request_in_a_hurry_gets_a_short_step_and_the_next_steps_are_capped(policy):
    sim, steps, decoding = flood_then_urgent(policy)
    first = steps[0]
    assert ("B", 6, True) in first and sim.first_token_step["B"] == 4  # the step B arrives before
    assert a_prefill(first) == 0  # not topped up with A's prefill ...
    assert {rid for rid, n, prefill in first if not prefill} == decoding == {"d0"}  # ... but A's decodes stay in
    pacer = sim.scheduler.pacer
    assert pacer.num_untopped_steps == 1
    window = steps[1:ARRIVAL_WINDOW_STEPS + 1]
    # capped, still progressing (fair: but for the step after B's, where A has been served less than B)
    assert sum(0 < a_prefill(step) <= CAP for step in window) >= ARRIVAL_WINDOW_STEPS - 2
    assert pacer.num_capped_steps >= ARRIVAL_WINDOW_STEPS - 2
    assert any(a_prefill(step) > CAP for step in steps[ARRIVAL_WINDOW_STEPS + 1:])  # the window is over: full steps
    sim.run()


def test_fcfs_tops_every_step_up():
    sim, steps, _ = flood_then_urgent("fcfs")
    assert sim.scheduler.pacer is None
    assert sim.first_token_step["B"] > 4 + 3  # B waits behind A's prefill
    assert all(sum(n for _, n, _ in step) == BUDGET for step in steps[:4])  # every step full of A's prefill
    sim.run()


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_equals_do_not_pace_each_other(policy):
    """The same scenario with B of A's class (priority 0; tenant A): no un-topped, no capped step."""
    sim = tenant_a_busy(policy, prompt_len=80, decode_len=30)
    sim.add("late", prompt_len=6, max_new=2, tenant="A", token=9)
    sim.run()
    assert sim.scheduler.pacer.num_untopped_steps == sim.scheduler.pacer.num_capped_steps == 0


def test_a_request_that_cannot_start_does_not_un_top_the_step():
    """B is not ready (its adapter is loading): A's prefill goes on, capped only; once B starts, its step is
    un-topped."""
    ready = {"B": False}
    sim = Sim("priority", max_num_seqs=4, budget=BUDGET, num_blocks=256,
              is_ready=lambda r: ready.get(r.request_id, True))
    for i in range(3):
        sim.add(f"p{i}", prompt_len=80, max_new=4, token=10 + i)
    sim.step()
    sim.add("B", prompt_len=6, max_new=2, priority=-1, token=9)
    for _ in range(3):
        out = sim.step()
        assert sum(s.num_new_tokens for s in out.scheduled) == CAP
    assert sim.scheduler.pacer.num_untopped_steps == 0
    ready["B"] = True
    out = sim.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("B", 6)]
    assert sim.scheduler.pacer.num_untopped_steps == 1
    sim.run()


def test_a_tenant_that_keeps_sending_short_requests_cannot_hold_the_others_back():
    """Under fair, B sends a short request every step; A's long prompts still get their share of the budget
    (B holds A back only while B has been served less than A) and finish while B keeps sending."""
    sim = Sim("fair", max_num_seqs=8, budget=BUDGET, num_blocks=512)
    for i in range(4):
        sim.add(f"A{i}", prompt_len=120, max_new=4, tenant="A", token=10 + i)
    for i in range(150):
        sim.add(f"B{i}", prompt_len=6, max_new=1, tenant="B", token=9)
        sim.step()
        if all(f"A{j}" in sim.finish_step for j in range(4)):
            break
    assert all(f"A{j}" in sim.finish_step for j in range(4)), sim.tokens
    assert sim.scheduler.pacer.num_untopped_steps > 0
    assert sim.tokens["A"] >= 0.3 * (sim.tokens["A"] + sim.tokens["B"]), sim.tokens
    sim.run()


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_paced_steps_give_the_greedy_output_of_transformers(policy):
    """The engine on a tiny float64 model: long bulk prompts are held back and capped while short urgent ones
    start, and every request still gives plain transformers' tokens."""
    model = tiny_model("llama")
    prompts = random_prompts([60, 70, 7, 6], seed=5)
    max_new = [6, 5, 4, 3]
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    generator = paged_hf.ContinuousBatchGenerator(model, PagedConfig(
        block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=16, scheduling_policy=policy))
    ids = [generator.add_request(p, greedy(n), tenant="bulk") for p, n in zip(prompts[:2], max_new[:2])]
    generator.step()
    urgent = {"priority": {"priority": -1}, "fair": {"tenant": "quiet"}}[policy]
    ids += [generator.add_request(p, greedy(n), **urgent) for p, n in zip(prompts[2:], max_new[2:])]
    outputs = {}
    while generator.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in generator.step())
    pacer = generator.scheduler.pacer
    assert pacer.num_untopped_steps >= 1 and pacer.num_capped_steps >= 1
    assert [outputs[i].outputs[0].token_ids for i in ids] == expected
    assert_no_leak(generator)
