"""The bound on a stream's gap between tokens (paged_hf.core.stream_pace): while a request decodes, a big prompt's
prefill takes only the tokens that keep a step within `max_stream_gap_s` by the fitted step cost, under every
policy; without decodes (or without the bound) it takes the whole budget. Driven through test_scheduling_policy's
`Sim` with steps that take `fixed + per_token * tokens` seconds (test_step_pacing's `StepClock`), then the engine
on a tiny float64 model against plain transformers."""

from __future__ import annotations

import pytest
from conftest import assert_no_leak, hf_greedy, random_prompts, tiny_model
from test_scheduling_policy import Sim, greedy
from test_step_pacing import StepClock, timed

import paged_hf
from paged_hf import PagedConfig
from paged_hf.core.step_pacing import ARRIVAL_WINDOW_STEPS, CAPPED_BUDGET_DIVISOR, LEAST_CAP_DIVISOR

BUDGET = 64
FIXED, PER_TOKEN = 0.02, 0.002  # a decode step ~22 ms, a full-budget step 148 ms


def stream_then_big_prompt(policy: str, gap: float | None):
    """A stream runs for 21 steps beside a short request (steps of 17, 15, 2 and 1 tokens are timed by then, the
    engine's first is not; `fair`'s pacing window after the short one's arrival is over), then a 400-token prompt
    arrives. -> (sim, [(the stream decoded, prefill tokens, step
    seconds)] per step from the arrival until the prompt's first token)."""
    clock = StepClock(FIXED, PER_TOKEN)
    sim = Sim(policy, max_num_seqs=4, budget=BUDGET, num_blocks=256, clock=clock, max_stream_gap_s=gap)
    timed(sim, clock)
    sim.add("stream", prompt_len=40, max_new=200, tenant="A")
    sim.step()
    sim.add("short", prompt_len=30, max_new=2, tenant="A", token=4)
    for _ in range(ARRIVAL_WINDOW_STEPS + 4):
        sim.step()
    sim.add("big", prompt_len=400, max_new=2, tenant="B", token=9)
    steps = []
    while "big" not in sim.first_token_step:
        before = clock.now
        out = sim.step()
        tokens = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        steps.append(("stream" in tokens, tokens.get("big", 0), clock.now - before))
    return sim, steps


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_big_prompt_keeps_a_running_streams_steps_within_the_gap(policy):
    gap = 0.1  # room for (0.1 - 0.02) / 0.002 = 40 tokens: the decode and 39 of prefill
    sim, steps = stream_then_big_prompt(policy, gap)
    assert sim.scheduler.step_timer.cost.fit() == pytest.approx((FIXED, PER_TOKEN))
    assert all(decoded for decoded, _, _ in steps)  # the stream got a token every step
    assert max(seconds for _, _, seconds in steps) <= gap + 1e-9
    prefills = [prefill for _, prefill, _ in steps]
    # at most 39 (38 where the fit's rounding shaves a hair), the first at most twice the largest step timed (17)
    assert prefills[0] == 33 and all(38 <= p <= 39 for p in prefills[1:-1]) and sum(prefills) == 400, prefills
    assert sim.scheduler.stream_pace.num_paced_steps == 1 + len(steps) - 1  # the short prompt's, untimed: 16
    sim.run()


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_without_the_bound_the_prompt_takes_the_whole_budget(policy):
    sim, steps = stream_then_big_prompt(policy, None)
    assert sim.scheduler.stream_pace is None
    assert max(prefill for _, prefill, _ in steps) == BUDGET - 1  # beside the stream's decode
    assert max(seconds for _, _, seconds in steps) == pytest.approx(FIXED + PER_TOKEN * BUDGET)
    sim.run()


def test_prefill_alone_takes_the_whole_budget_and_never_less_than_the_least_share():
    clock = StepClock(FIXED, PER_TOKEN)
    sim = Sim("fcfs", max_num_seqs=4, budget=BUDGET, num_blocks=256, clock=clock, max_stream_gap_s=0.001)
    timed(sim, clock)
    sim.add("big", prompt_len=100, max_new=20)
    assert sim.step().num_tokens == BUDGET  # nothing decodes: no bound
    sim.step()
    sim.step()  # the prompt's last 36 tokens, then a decode: steps of two sizes timed
    sim.add("other", prompt_len=300, max_new=2, token=5)
    out = sim.step()  # the gap is shorter than a step's fixed cost: prefill still moves on, by the least share
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {
        "big": 1, "other": BUDGET // LEAST_CAP_DIVISOR}
    sim.run()


def test_untimed_steps_give_prefill_a_quarter_of_the_budget_beside_decodes():
    sim = Sim("fcfs", max_num_seqs=4, budget=BUDGET, num_blocks=256, max_stream_gap_s=0.1)  # a clock standing still
    sim.add("stream", prompt_len=6, max_new=50)
    sim.step()
    sim.add("big", prompt_len=300, max_new=2, token=9)
    out = sim.step()
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {
        "stream": 1, "big": BUDGET // CAPPED_BUDGET_DIVISOR}
    sim.run()


def test_the_bound_is_checked_and_is_a_serve_flag():
    from paged_hf.entrypoints import cli
    from paged_hf.entrypoints.cli_args import engine_config

    with pytest.raises(ValueError, match="max_stream_gap_s must be a number of seconds > 0"):
        PagedConfig(max_stream_gap_s=0)
    with pytest.raises(ValueError, match="max_stream_gap_s"):
        PagedConfig(max_stream_gap_s="fast")
    args = cli.build_parser().parse_args(["serve", "--max-stream-gap", "0.25"])
    assert engine_config(args) == {"max_stream_gap_s": 0.25}
    assert engine_config(cli.build_parser().parse_args(["serve"])) == {}


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_paced_prefill_gives_the_greedy_output_of_transformers(policy):
    """A long prompt read in paced chunks beside running decodes: every request still gives plain
    transformers' tokens, and nothing leaks."""
    model = tiny_model("llama")
    prompts = random_prompts([7, 90, 6, 75], seed=11)
    max_new = [12, 4, 10, 5]
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    generator = paged_hf.ContinuousBatchGenerator(model, PagedConfig(
        block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32, scheduling_policy=policy,
        max_stream_gap_s=1e-6))  # shorter than any step: prefill beside decodes takes the least share
    ids = [generator.add_request(prompts[0], greedy(max_new[0]))]
    generator.step()
    ids += [generator.add_request(p, greedy(n)) for p, n in zip(prompts[1:], max_new[1:])]
    outputs = {}
    while generator.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in generator.step())
    assert [outputs[i].outputs[0].token_ids for i in ids] == expected
    assert generator.scheduler.stream_pace.num_paced_steps > 0
    assert_no_leak(generator)
