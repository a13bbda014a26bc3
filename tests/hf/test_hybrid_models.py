"""Hybrid models (linear-attention, SSM and convolution layers beside attention) on the paged engine: HF's
greedy tokens in batches with chunked prefill (continuing chunks carry the state), preemption (the state is
recomputed), n = 2 and beams (a forked child copies its parent's state), aborts (no slot or block leaked).

One family per kind of recurrent layer: Gated DeltaNet (Qwen3-Next), Mamba (its selective scan ignores a
previous state: continuing chunks go token by token), Mamba-2 with attention and MoE (Granite-4 hybrid),
short convolutions (LFM2), Mamba with attention (Jamba). float64: no argmax tie can hide a difference.
"""

from __future__ import annotations

import pytest
import torch
from architectures import build
from conftest import assert_no_leak, hf_beam, hf_greedy

import paged_hf
from paged_hf import BeamSearchParams, SamplingParams

FAMILIES = ["qwen3_next", "mamba", "granitemoehybrid", "lfm2", "jamba"]
GREEDY = SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True)


def prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 120, (n,), generator=generator).tolist() for n in lengths]


def assert_no_state_leak(engine) -> None:
    assert_no_leak(engine)
    slots = engine.kv_cache_manager.state_slots
    assert slots.num_free == slots.num_slots


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request):
    model = build(request.param, torch.float64)
    batch = prompts([23, 3, 40, 9, 17])
    return request.param, model, batch, [hf_greedy(model, p, GREEDY.max_new_tokens) for p in batch]


def test_greedy_tokens_equal_hf_with_chunked_prefill_and_mixed_steps(hybrid):
    name, model, batch, expected = hybrid
    engine = paged_hf.wrap(model, num_blocks=128, block_size=4, max_num_batched_tokens=12, max_num_seqs=3).generator
    assert engine.info.is_hybrid and engine.runner.recurrent_mixers.sites, name
    outputs = engine.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected, name
    assert_no_state_leak(engine)


def test_preempted_requests_recompute_their_state(hybrid):
    name, model, batch, expected = hybrid
    engine = paged_hf.wrap(model, num_blocks=18, block_size=4, max_num_batched_tokens=16, max_num_seqs=4).generator
    outputs = engine.generate(batch, GREEDY, use_tqdm=False)
    assert engine.stats()["num_preemptions"] > 0, name
    assert [o.outputs[0].token_ids for o in outputs] == expected, name
    assert_no_state_leak(engine)


def test_n_2_children_fork_the_parents_state(hybrid):
    """Greedy children both equal HF; the second computes its last prompt token from a copy of the state."""
    name, model, batch, expected = hybrid
    engine = paged_hf.wrap(model, num_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=6).generator
    params = SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True, n=2)
    outputs = engine.generate(batch[:3], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected[:3]], name
    assert_no_state_leak(engine)


def test_beam_search_forks_copy_the_state(hybrid):
    """Beams equal HF's beam search (hypotheses and scores): every fork starts from a copy of its parent's state,
    and beams that lose their place give their slots back."""
    name, model, batch, _ = hybrid
    engine = paged_hf.wrap(model, num_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=8).generator
    expected = [hf_beam(model, p, 3, 6) for p in batch[:2]]
    outputs = engine.beam_search(batch[:2], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    got = [[(s.output_token_ids, s.score) for s in o.sequences] for o in outputs]
    assert [[tokens for tokens, _ in beams] for beams in got] == [[tokens for tokens, _ in beams] for beams in expected]
    assert [[score for _, score in beams] for beams in got] == \
        [[pytest.approx(score, rel=1e-9) for _, score in beams] for beams in expected], name
    assert_no_state_leak(engine)


def test_abort_frees_the_state_slot_and_a_repeated_prompt_gives_the_same_tokens():
    model = build("qwen3_next", torch.float64)
    engine = paged_hf.wrap(model, num_blocks=64, block_size=4).generator  # prefix caching asked for: turned off
    assert not engine.config.enable_prefix_caching
    system = prompts([30])[0]
    request_id = engine.add_request(system + [9, 10], GREEDY)
    engine.step()
    engine.abort(request_id)
    engine.step()
    assert_no_state_leak(engine)
    first, second = (engine.generate([system + [11]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for _ in "ab")
    assert first == second == hf_greedy(model, system + [11], GREEDY.max_new_tokens)


def test_speculative_decoding_of_a_hybrid_is_refused():
    with pytest.raises(ValueError, match="hybrid model"):
        paged_hf.wrap(build("lfm2", torch.float64), speculative={"method": "ngram", "num_speculative_tokens": 2})


def test_xlstm_steps_longer_than_the_pieces_its_forward_cuts_an_input_into():
    """xLSTM's forward cuts an input longer than `max_inference_chunksize` into pieces, which would cut a packed
    row mid-request: a step lifts the limit, and the tokens stay HF's (whose own prompts are cut)."""
    model = build("xlstm", torch.float64)
    model.config.max_inference_chunksize = 5
    batch = prompts([23, 3, 9])
    engine = paged_hf.wrap(model, num_blocks=64, block_size=4, max_num_batched_tokens=16).generator
    outputs = engine.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, GREEDY.max_new_tokens) for p in batch]
    assert model.config.max_inference_chunksize == 5  # lifted within steps only
    assert_no_state_leak(engine)
