"""Prefix caching, copy-on-write and parallel sampling: same tokens with caching on and off (and as HF's
generate), hits that really happen, n children that share their prompt's blocks, and no leaked block."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import VOCAB, assert_no_leak, hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.core.block_pool import BlockPool
from paged_hf.core.kv_cache_manager import KVCacheManager
from paged_hf.core.request import Request, RequestStatus
from paged_hf.core.scheduler import Scheduler


def greedy(max_new_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, n=n)


def engine(model, **config) -> paged_hf.ContinuousBatchGenerator:
    return paged_hf.ContinuousBatchGenerator(model, PagedConfig(**{"block_size": 4, **config}))


def shared_prefix_prompts(prefix_len: int, suffix_lens: list[int], seed: int = 0) -> list[list[int]]:
    [prefix] = random_prompts([prefix_len], seed=seed)
    return [prefix + suffix for suffix in random_prompts(suffix_lens, seed=seed + 1)]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def shared_workload(llama):
    """Prompts sharing a 21-token prefix (one repeated exactly), and HF's greedy answers."""
    prompts = shared_prefix_prompts(21, [3, 8, 1, 5, 12])
    prompts.append(list(prompts[1]))
    max_new = [9, 14, 6, 11, 8, 14]
    return prompts, max_new, [hf_greedy(llama, p, n) for p, n in zip(prompts, max_new)]


# --- prefix caching ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("enable", [True, False])
def test_shared_prefixes_give_the_same_tokens_with_caching_on_and_off(llama, shared_workload, enable):
    prompts, max_new, expected = shared_workload
    generator = engine(llama, num_blocks=96, max_num_batched_tokens=16, enable_prefix_caching=enable)
    outputs = generator.generate(prompts, [greedy(n) for n in max_new], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = generator.stats()
    if enable:
        assert stats["prefix_cache_hits"] >= 5 * 20  # every later prompt finds the 5 blocks of the prefix
        assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)
    else:
        assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0
    assert_no_leak(generator)


def test_caching_with_chunked_prefill_and_preemption_at_once(llama, shared_workload):
    """A pool of 20 blocks and a budget of 8 tokens: prompts are chunked, requests preempted, and the
    recomputed ones find their own blocks (and each other's) again. The tokens never change."""
    prompts, max_new, expected = shared_workload
    generator = engine(llama, num_blocks=20, max_num_batched_tokens=8)
    outputs = generator.generate(prompts, [greedy(n) for n in max_new], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = generator.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert generator.scheduler.preempted_prefix_cache_hits > 0  # resumed requests skip their cached blocks
    assert_no_leak(generator)


def test_hits_are_counted_in_tokens_and_a_full_hit_still_computes_the_last_token(llama):
    prompt = random_prompts([12])[0]  # 3 full blocks of 4
    expected = hf_greedy(llama, prompt, 5)
    generator = engine(llama, num_blocks=32)
    for round_ in range(2):
        [out] = generator.generate([prompt], greedy(5), use_tqdm=False)
        assert out.outputs[0].token_ids == expected
    stats = generator.stats()
    assert stats["prefix_cache_queries"] == 24
    assert stats["prefix_cache_hits"] == 8  # 2 blocks: the block holding the last prompt token is computed
    # the first answer's decode blocks are cached too: its prompt + 4 of its tokens hit 4 blocks
    extended = prompt + expected[:4] + [7]
    [out] = generator.generate([extended], greedy(4), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(llama, extended, 4)
    assert generator.stats()["prefix_cache_hits"] == 8 + 16
    assert_no_leak(generator)


def test_identical_prompts_in_one_step_compute_their_own_blocks(llama):
    """Blocks being computed in this very step are not hits yet: both requests compute them, and only the
    first block published per hash is cached (the duplicate is not, and is evicted first)."""
    prompt = random_prompts([10])[0]
    generator = engine(llama, num_blocks=32, max_num_batched_tokens=64)
    outputs = generator.generate([prompt, prompt], greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(llama, prompt, 6)] * 2
    assert generator.stats()["prefix_cache_hits"] == 0
    assert len(generator.block_pool.cached_blocks) == 3  # 2 prompt blocks + 1 decode block, once each
    assert_no_leak(generator)


def test_cache_salt_separates_tenants(llama):
    prompt = random_prompts([13])[0]
    generator = engine(llama, num_blocks=32)
    for salt, expected_hits in [("a", 0), ("b", 0), ("a", 12), (None, 0), (None, 12)]:
        before = generator.stats()["prefix_cache_hits"]
        request_id = generator.add_request(prompt, greedy(2), cache_salt=salt)
        while generator.has_unfinished_requests():
            generator.step()
        assert generator.stats()["prefix_cache_hits"] - before == expected_hits, (salt, request_id)
    with pytest.raises(ValueError, match="cache_salt"):
        generator.add_request(prompt, greedy(2), cache_salt=3)
    assert_no_leak(generator)


# --- parallel sampling: fork and copy-on-write --------------------------------------------------------------

@pytest.mark.parametrize("length", [7, 9, 1, 14])  # 7 and 14: the last prompt block is shared and partial
def test_n_greedy_children_equal_the_single_greedy_answer(llama, length):
    prompt = random_prompts([length], seed=length)[0]
    expected = hf_greedy(llama, prompt, 10)
    for enable in (True, False):
        generator = engine(llama, num_blocks=48, enable_prefix_caching=enable)
        # round 2 with caching: the prompt's blocks are hits (length 9: they reach the fork point at once)
        for round_ in (1, 2) if enable else (1,):
            [out] = generator.generate([prompt], greedy(10, n=4), use_tqdm=False)
            assert [c.token_ids for c in out.outputs] == [expected] * 4
            assert [c.index for c in out.outputs] == [0, 1, 2, 3]
            # copy-on-write exactly once per writer of the shared partial block; the last writes in place
            assert generator.kv_cache_manager.num_block_copies == round_ * (3 if (length - 1) % 4 else 0)
            # the prompt is looked up once, not once per child
            assert generator.stats()["prefix_cache_queries"] == (round_ * length if enable else 0)
            assert_no_leak(generator)
        if enable:
            assert generator.stats()["prefix_cache_hits"] == (length - 1) // 4 * 4


def test_n_children_under_preemption_chunked_prefill_and_few_seats(llama):
    """Parents and forked children are preempted and resumed, prompts are chunked, and n > max_num_seqs
    queues the siblings without a seat as plain requests. Every child still gives the greedy answer."""
    prompts = shared_prefix_prompts(9, [2, 5, 0])
    expected = [hf_greedy(llama, p, 16) for p in prompts]
    for config in (dict(num_blocks=14, max_num_batched_tokens=6), dict(num_blocks=40, max_num_seqs=2)):
        generator = engine(llama, **config)
        outputs = generator.generate(prompts, greedy(16, n=3), use_tqdm=False)
        for out, answer in zip(outputs, expected):
            assert [c.token_ids for c in out.outputs] == [answer] * 3
        stats = generator.stats()
        if config["num_blocks"] == 14:
            assert stats["num_preemptions"] > 0
        else:  # one sibling per request found no seat: it ran as a plain request, with prefix hits
            assert stats["prefix_cache_queries"] == 2 * sum(len(p) for p in prompts)
            assert stats["prefix_cache_hits"] > 0
        assert_no_leak(generator)


def test_sampled_children_differ_and_are_reproducible(llama):
    prompt = random_prompts([10])[0]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    generator = engine(llama, num_blocks=64)
    [first] = generator.generate([prompt], params, use_tqdm=False)
    children = [c.token_ids for c in first.outputs]
    assert len({tuple(c) for c in children}) == 4
    # the same seed in another batch (more requests, another order): the same tokens
    [_, again] = generator.generate([prompt[:5], prompt], [greedy(3), params], use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == children
    assert_no_leak(generator)


def test_sampled_children_follow_the_models_distribution():
    """The first token of 3000 children against softmax(logits) at temperature 1 (chi-square, 7 degrees
    of freedom). Children that share a copied block would sample from the wrong logits."""
    config = transformers.LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # a peaked, far from uniform distribution
    prompt = [1, 5, 2, 7, 3, 6]  # 6 tokens, block_size 4: the last prompt block is shared and partial
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)  # [8]
    assert probs.max() > 0.3 and probs.min() < 0.05
    num = 3000  # seats for all: every child forks and computes one token (a batched one-token query)
    generator = engine(model, num_blocks=4096, max_num_seqs=num, max_num_batched_tokens=num)
    [out] = generator.generate([prompt], SamplingParams(max_new_tokens=1, n=num, seed=7), use_tqdm=False)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out.outputs]), minlength=8).double()
    expected = probs * num
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (chi2, counts.tolist(), expected.tolist())  # p = 0.001 for 7 degrees of freedom
    uniform = float(((counts - num / 8) ** 2 / (num / 8)).sum())
    assert uniform > 100  # the test can tell the model's distribution from a uniform one
    assert_no_leak(generator)


def test_children_finishing_in_any_order_and_aborts_leak_nothing(llama):
    prompt = random_prompts([11])[0]
    generator = engine(llama, num_blocks=64, max_num_batched_tokens=4)
    stops = list(range(3, VOCAB, 3))  # a third of the vocabulary ends a child: they end at different steps
    [out] = generator.generate([prompt], SamplingParams(max_new_tokens=20, n=6, seed=3, stop_token_ids=stops),
                               use_tqdm=False)
    lengths = [len(c.token_ids) for c in out.outputs]
    assert len(set(lengths)) > 1, lengths
    assert_no_leak(generator)
    # abort while the parent is in its chunked prefill (siblings not forked yet), then after the fork
    for num_steps in (1, 5):
        fresh = random_prompts([11], seed=num_steps)[0]  # not cached: the prefill takes 3 steps of 4 tokens
        request_id = generator.add_request(fresh, SamplingParams(max_new_tokens=20, n=3, seed=1))
        for _ in range(num_steps):
            generator.step()
        forked = generator.stats()["num_running"] == 3
        assert forked == (num_steps == 5)
        generator.abort(request_id)
        assert_no_leak(generator)
        [final] = generator.step()
        assert [c.finish_reason for c in final.outputs] == ["abort"] * 3


# --- the scheduler's fork bookkeeping, without a model ----------------------------------------------------

def make_scheduler(num_blocks: int = 16, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(BlockPool(num_blocks), 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def parent_with_siblings(prompt: list[int], n: int) -> list[Request]:
    children = [Request("r", i, list(prompt), SamplingParams(n=n)) for i in range(n)]
    children[0].pending_forks = children[1:]
    for child in children[1:]:
        child.fork_parent = children[0]
    return children


def run_step(scheduler: Scheduler):
    out = scheduler.schedule()
    for scheduled in out.scheduled:
        scheduler.advance(scheduled)
    return out


def test_finishing_siblings_before_their_parent_frees_everything():
    """The generator's abort order: siblings waiting for their fork first, then the parent (waiting or in
    its prefill); a parent with pending siblings is never finished."""
    scheduler = make_scheduler()
    for run_first in (False, True):
        parent, second, third = parent_with_siblings(list(range(10)), 3)
        scheduler.add(parent)
        if run_first:
            scheduler.schedule()
            assert scheduler.running == [parent] and parent.block_ids
        with pytest.raises(AssertionError, match="siblings"):
            scheduler.finish(parent, "abort")
        for request in (third, second, parent):
            scheduler.finish(request, "abort")
        assert parent.pending_forks == [] and second.fork_parent is None
        assert not scheduler.has_unfinished() and scheduler.kv_cache_manager.block_pool.num_free_blocks == 16


def test_a_parent_preempted_in_its_prefill_keeps_its_siblings_and_forks_later():
    scheduler = make_scheduler(max_num_seqs=3, budget=4)
    parent, *siblings = parent_with_siblings(list(range(9)), 3)
    scheduler.add(parent)
    run_step(scheduler)
    assert parent.num_computed_tokens == 4 and scheduler.num_waiting == 2
    scheduler._preempt(scheduler.running.pop())
    assert parent.pending_forks == siblings and scheduler.num_waiting == 3
    out = run_step(scheduler)  # back with a hit on its first block, then the next chunk
    assert [s.num_new_tokens for s in out.scheduled] == [4] and scheduler.preempted_prefix_cache_hits == 4
    assert [r.status for r in siblings] == [RequestStatus.RUNNING] * 2  # forked in advance()
    assert all(r.block_ids == parent.block_ids and r.num_computed_tokens == 8 for r in siblings)
    assert all(scheduler.kv_cache_manager.block_pool.blocks[b].ref_count == 3 for b in parent.block_ids)
    out = scheduler.schedule()  # every child computes the last prompt token in its own new block
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 1] and all(s.samples for s in out.scheduled)
    assert len({r.block_ids[2] for r in (parent, *siblings)}) == 3
    assert out.block_copies == []  # 8 tokens: no shared partial block, nothing to copy
    for request in [parent, *siblings]:
        scheduler.finish(request, "stop")
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 16


def test_a_copy_into_a_block_freed_before_the_step_is_dropped():
    kv_cache_manager = KVCacheManager(BlockPool(4), 4)
    parent, child = (Request("r", i, list(range(7)), SamplingParams()) for i in range(2))
    assert kv_cache_manager.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv_cache_manager.fork(parent, child)
    assert kv_cache_manager.allocate_slots(child, 1)  # writes into the shared partial block: a copy
    assert len(kv_cache_manager._block_copies) == 1 and child.block_ids[1] != parent.block_ids[1]
    kv_cache_manager.free(child)  # e.g. aborted before the step ran: nobody will read the copy
    assert kv_cache_manager.take_block_copies() == []
    kv_cache_manager.free(parent)
    assert kv_cache_manager.block_pool.num_free_blocks == 4
