"""Scheduling policies (fcfs, priority, fair), the `is_ready` hook and the bounded wait for an adapter slot.

The scheduler is driven alone (bookkeeping over ints, as the engine drives it: schedule, advance, append a
token where the step samples, finish at max_new_tokens), so the tests count steps exactly; then the engine on
a tiny float64 model checks that preempted requests still give plain transformers' greedy tokens.
"""

from __future__ import annotations

from collections import deque

import pytest
from conftest import assert_no_leak, hf_greedy, random_prompts, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.core.block_pool import BlockPool
from paged_hf.core.kv_cache_manager import KVCacheManager
from paged_hf.core.request import Request
from paged_hf.core.scheduler import Scheduler
from paged_hf.outputs import FinishReason

BLOCK = 4


class Sim:
    """A scheduler and its pool, stepped as the engine steps them (token id 7 for every sampled token). The
    scheduler's clock stands still unless a test passes one (`clock`)."""

    def __init__(self, policy="fcfs", num_blocks=64, max_num_seqs=4, budget=32, **kwargs):
        pool = BlockPool(num_blocks, enable_caching=True)
        self.pool = pool
        kwargs.setdefault("clock", lambda: 0.0)  # steps take no time: the step pacer keeps its least cap
        self.scheduler = Scheduler(KVCacheManager(pool, BLOCK), max_num_seqs, budget, policy=policy, **kwargs)
        self.steps = 0
        self.first_token_step: dict[str, int] = {}
        self.finish_step: dict[str, int] = {}
        self.tokens: dict[str | None, int] = {}  # tenant -> tokens scheduled

    def add(self, name, prompt_len=6, max_new=4, priority=0, tenant=None, adapter_version=None, token=3) -> Request:
        request = Request(name, 0, [token] * prompt_len, SamplingParams(max_new_tokens=max_new), priority=priority,
                          tenant=tenant, adapter=None if adapter_version is None else f"a{adapter_version}",
                          adapter_version=adapter_version)
        self.scheduler.add(request)
        return request

    def step(self):
        self.steps += 1
        out = self.scheduler.schedule()
        for scheduled in out.scheduled:
            request = scheduled.request
            self.tokens[request.tenant] = self.tokens.get(request.tenant, 0) + scheduled.num_new_tokens
            samples = scheduled.samples
            self.scheduler.advance(scheduled)
            if samples:
                request.append_token(7)
                self.first_token_step.setdefault(request.request_id, self.steps)
                if len(request.output_token_ids) >= request.sampling_params.max_new_tokens:
                    self.scheduler.finish(request, FinishReason.LENGTH)
                    self.finish_step[request.request_id] = self.steps
        return out

    def run(self, max_steps=10_000):
        while self.scheduler.has_unfinished():
            self.step()
            assert self.steps < max_steps, "the scheduler stopped making progress"
        assert self.pool.num_free_blocks == self.pool.num_blocks


# --- fcfs ------------------------------------------------------------------------------------------------------

def test_fcfs_is_the_default_and_keeps_a_plain_deque():
    sim = Sim()
    assert sim.scheduler.policy == "fcfs" and isinstance(sim.scheduler.waiting, deque)
    sim.add("low", priority=5)
    sim.add("high", priority=-5)
    assert [r.request_id for r in sim.scheduler.waiting] == ["low", "high"]  # arrival order, priority unread
    with pytest.raises(ValueError, match="scheduling_policy"):
        Sim(policy="lottery")


# --- priority --------------------------------------------------------------------------------------------------

def test_priority_orders_the_queue_and_ties_keep_arrival_order():
    sim = Sim("priority", max_num_seqs=1)
    for name, priority in [("a", 1), ("b", 0), ("c", 1), ("d", -2), ("e", 0)]:
        sim.add(name, priority=priority)
    assert [r.request_id for r in sim.scheduler.waiting] == ["d", "b", "e", "a", "c"]
    sim.run()
    assert sorted(sim.finish_step, key=sim.finish_step.get) == ["d", "b", "e", "a", "c"]


def test_an_urgent_request_preempts_the_lowest_ranked_when_the_batch_is_full():
    """max_num_seqs full of priority-0 decodes: a priority -1 request takes the newest one's seat and gets
    its first token in the step it arrives in (its prompt fits the budget); the preempted request keeps its
    output and finishes with all of its tokens."""
    sim = Sim("priority", max_num_seqs=3, budget=32)
    bulk = [sim.add(f"bulk{i}", max_new=20) for i in range(3)]
    for _ in range(4):
        sim.step()
    outputs_before = [list(r.output_token_ids) for r in bulk]
    sim.add("urgent", priority=-1, max_new=3)
    out = sim.step()
    assert [r.request_id for r in out.preempted] == ["bulk2"]  # the newest of the lowest rank
    assert sim.first_token_step["urgent"] == sim.steps
    assert bulk[2].output_token_ids == outputs_before[2] and bulk[2].num_preemptions == 1
    sim.run()
    assert sim.finish_step["urgent"] < min(sim.finish_step[r.request_id] for r in bulk)
    assert all(len(r.output_token_ids) == 20 for r in bulk)


def test_equal_priority_never_preempts():
    sim = Sim("priority", max_num_seqs=2)
    sim.add("a", max_new=10)
    sim.add("b", max_new=10)
    sim.step()
    sim.add("c", max_new=2)
    for _ in range(5):
        assert not sim.step().preempted
    assert "c" not in sim.first_token_step


def test_priority_preempts_for_blocks_too():
    """Seats are free but the pool is not: the urgent request takes a low-ranked request's blocks (its prompt
    shares no block with theirs, and even with one of their decodes left out for a step, split decodes, its 2
    blocks and the other decode's 1 exceed the 2 free)."""
    sim = Sim("priority", num_blocks=6, max_num_seqs=8, budget=64)
    sim.add("bulk0", prompt_len=8, max_new=8)
    sim.add("bulk1", prompt_len=8, max_new=8)
    sim.step()
    sim.add("urgent", prompt_len=8, max_new=2, priority=-3, token=5)
    out = sim.step()
    assert out.preempted and "urgent" in sim.first_token_step
    sim.run()


# --- fair ------------------------------------------------------------------------------------------------------

def test_fair_gives_a_quiet_tenant_a_seat_at_once_fcfs_makes_it_wait():
    """Tenant A sends 12 long requests at once, B one short one: under fair B starts in the step it arrives in
    (it takes the seat of A's lowest-ranked request); under fcfs it waits behind A's queue."""
    first_token = {}
    for policy in ("fcfs", "fair"):
        sim = Sim(policy, max_num_seqs=4, budget=16, num_blocks=128)
        for i in range(12):
            sim.add(f"A{i}", prompt_len=8, max_new=12, tenant="A")
        for _ in range(3):
            sim.step()
        arrival = sim.steps
        sim.add("B", prompt_len=4, max_new=2, tenant="B")
        sim.run()
        first_token[policy] = sim.first_token_step["B"] - arrival
    assert first_token["fair"] == 1
    assert first_token["fcfs"] > 10


def test_fair_shares_follow_the_weights_while_both_tenants_are_backlogged():
    sim = Sim("fair", max_num_seqs=8, budget=16, num_blocks=512, tenant_weights={"A": 3, "B": 1})
    for i in range(60):
        sim.add(f"A{i}", prompt_len=8, max_new=6, tenant="A")
        sim.add(f"B{i}", prompt_len=8, max_new=6, tenant="B")
    for _ in range(40):
        sim.step()
    assert 2.5 <= sim.tokens["A"] / sim.tokens["B"] <= 3.5, sim.tokens
    sim.run()


def test_an_idle_tenant_banks_no_credit():
    """A ran alone for a while; B arrives with as much work: from then on they share evenly, B does not get
    the whole server until it has caught up with A's past tokens."""
    sim = Sim("fair", max_num_seqs=8, budget=16, num_blocks=512)
    for i in range(60):
        sim.add(f"A{i}", prompt_len=8, max_new=6, tenant="A")
    for _ in range(30):
        sim.step()
    before = dict(sim.tokens)
    for i in range(60):
        sim.add(f"B{i}", prompt_len=8, max_new=6, tenant="B")
    for _ in range(40):
        sim.step()
    a, b = sim.tokens["A"] - before["A"], sim.tokens["B"]
    assert 0.6 <= a / b <= 1.6, (a, b)
    sim.run()


def test_the_adapter_is_the_tenant_by_default(llama):
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(block_size=4, num_blocks=64,
                                                                     scheduling_policy="fair"))
    rid = generator.add_request([5, 6, 7], greedy(2), tenant="alice")
    other = generator.add_request([5, 6, 7], greedy(2))
    assert generator.groups[rid].children[0].tenant == "alice"
    assert generator.groups[other].children[0].tenant is None  # the base model
    while generator.has_unfinished_requests():
        generator.step()


# --- is_ready and the adapter slots ------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_a_request_that_is_not_ready_keeps_its_place_and_others_pass_it(policy):
    loading = {"slow"}
    sim = Sim(policy, max_num_seqs=1, is_ready=lambda r: r.request_id not in loading)
    sim.add("slow", tenant="T")
    sim.add("next", tenant="T")
    sim.step()
    assert "next" in sim.first_token_step and "slow" not in sim.first_token_step
    assert [r.request_id for r in sim.scheduler.waiting] == ["slow"]
    sim.add("later", tenant="T")
    assert [r.request_id for r in sim.scheduler.waiting] == ["slow", "later"]
    loading.clear()
    sim.run()
    assert sim.finish_step["slow"] < sim.finish_step["later"]


def test_a_request_that_is_not_ready_never_preempts():
    ready = {"urgent": False}
    sim = Sim("priority", max_num_seqs=1, is_ready=lambda r: ready.get(r.request_id, True))
    sim.add("bulk", max_new=6)
    sim.step()
    sim.add("urgent", priority=-1)
    assert not sim.step().preempted
    ready["urgent"] = True
    assert sim.step().preempted
    sim.run()


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_request_waiting_for_an_adapter_slot_is_not_starved(policy):
    """One slot; adapter 1's requests keep coming, adapter 2's request waits. After max_adapter_wait_steps it
    is no longer passed: adapter 1 drains and adapter 2 gets the slot (not every step: no thrashing)."""
    sim = Sim(policy, max_num_seqs=4, max_loras=1, max_adapter_wait_steps=5, num_blocks=256)
    sim.add("x0", adapter_version=1, max_new=3)
    sim.step()
    sim.add("y", adapter_version=2, max_new=3)
    for i in range(1, 40):
        sim.add(f"x{i}", adapter_version=1, max_new=3)
        sim.step()
        assert len({r.adapter_version for r in sim.scheduler.running}) <= 1
    assert "y" in sim.finish_step and sim.first_token_step["y"] <= 2 + 5 + 4
    sim.run()


# --- no starvation: a property over random arrivals ------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(policy=st.sampled_from(["fcfs", "priority", "fair"]),
       arrivals=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 14), st.integers(1, 8), st.integers(-2, 2),
                                   st.sampled_from(["A", "B", "C"])), min_size=1, max_size=25))
def test_every_request_finishes_within_a_bound(policy, arrivals):
    """Random arrival steps, prompt lengths, outputs, priorities and tenants, a pool that forces preemption:
    every request finishes, within a bound of the total work, and no block leaks."""
    sim = Sim(policy, num_blocks=12, max_num_seqs=3, budget=8)
    by_step: dict[int, list] = {}
    for i, (step, prompt_len, max_new, priority, tenant) in enumerate(arrivals):
        by_step.setdefault(step, []).append((f"r{i}", prompt_len, max_new, priority if policy == "priority" else 0,
                                             tenant))
    total_work = sum(p + m for _, p, m, _, _ in arrivals)
    while by_step or sim.scheduler.has_unfinished():
        for name, prompt_len, max_new, priority, tenant in by_step.pop(sim.steps, []):
            sim.add(name, prompt_len, max_new, priority, tenant)
        sim.step()
        assert sim.steps <= 31 + 4 * total_work, "a request starves"
    assert len(sim.finish_step) == len(arrivals)
    assert sim.pool.num_free_blocks == sim.pool.num_blocks


# --- the engine: preempted requests give transformers' tokens ---------------------------------------------------

def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_preempted_requests_finish_with_the_greedy_output_of_transformers(llama, policy):
    prompts = random_prompts([9, 5, 12, 7, 6], seed=3)
    max_new = [10, 12, 8, 9, 5]
    expected = [hf_greedy(llama, p, n) for p, n in zip(prompts, max_new)]
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(
        block_size=4, num_blocks=64, max_num_seqs=3, max_num_batched_tokens=16, scheduling_policy=policy))
    ids = [generator.add_request(p, greedy(n), tenant="bulk") for p, n in zip(prompts[:3], max_new[:3])]
    for _ in range(4):
        generator.step()
    urgent = {"priority": {"priority": -1}, "fair": {"tenant": "quiet"}}[policy]
    ids += [generator.add_request(p, greedy(n), **urgent) for p, n in zip(prompts[3:], max_new[3:])]
    outputs = {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            outputs[output.request_id] = output
    assert generator.stats()["num_preemptions"] > 0
    assert [outputs[i].outputs[0].token_ids for i in ids] == expected
    assert_no_leak(generator)


def test_priority_is_checked_at_submission(llama):
    fcfs = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(block_size=4, num_blocks=16))
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.add_request([5, 6], greedy(2), priority=-1)
    ranked = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(block_size=4, num_blocks=16,
                                                                  scheduling_policy="priority"))
    for bad in ("high", 1.5, True):
        with pytest.raises(ValueError, match="priority must be an int"):
            ranked.add_request([5, 6], greedy(2), priority=bad)
    with pytest.raises(ValueError, match="tenant"):
        ranked.add_request([5, 6], greedy(2), tenant=3)
    with pytest.raises(ValueError, match="scheduling_policy"):
        PagedConfig(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="tenant_weights"):
        PagedConfig(scheduling_policy="fair", tenant_weights={"a": 0})
    assert not ranked.has_unfinished_requests()
    outputs = ranked.generate([[5, 6, 7], [8, 9]], greedy(3), use_tqdm=False, priority=[1, -1])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]


def test_the_real_model_answers_the_same_with_and_without_preemption(loaded):
    """The default model (float32): bulk requests preempted by an urgent one finish with the tokens they get
    when nothing preempts them (fcfs, seats for all)."""
    model, tokenizer = loaded
    prompts = [tokenizer(text)["input_ids"] for text in (
        "The capital of France is", "List three prime numbers:", "Hello! My name")]

    def run(policy: str, max_num_seqs: int) -> tuple[list[list[int]], int]:
        generator = paged_hf.ContinuousBatchGenerator(model, PagedConfig(
            num_blocks=32, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, scheduling_policy=policy,
            pack_linear_weights=False))
        urgent = {"priority": -1} if policy == "priority" else {}
        ids = [generator.add_request(p, greedy(8)) for p in prompts[:2]]
        for _ in range(2):
            generator.step()
        ids.append(generator.add_request(prompts[2], greedy(3), **urgent))
        outputs = {}
        while generator.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in generator.step())
        assert_no_leak(generator)
        return [outputs[i].outputs[0].token_ids for i in ids], generator.stats()["num_preemptions"]

    preempted, num_preemptions = run("priority", 2)
    plain, none = run("fcfs", 3)
    assert num_preemptions >= 1 and none == 0
    assert preempted == plain
