"""Beam search on the paged cache: hypotheses and scores equal HF's beam search (one prompt at a time)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, assert_no_leak, hf_beam, random_prompts, tiny_model

import paged_hf
from paged_hf import BeamSearchParams, PagedConfig, SamplingParams


def engine_beam(generator, prompts, params):
    outputs = generator.beam_search(prompts, params)
    return [[(s.output_token_ids, s.score) for s in o.sequences] for o in outputs]


def assert_same(got, expected, rel=0.0):
    """Same hypotheses in the same order; scores equal (to `rel` where the logits themselves differ)."""
    assert [[tokens for tokens, _ in beams] for beams in got] == [[tokens for tokens, _ in beams] for beams in expected]
    assert [[score for _, score in beams] for beams in got] == \
        [[pytest.approx(score, rel=rel, abs=0) for _, score in beams] for beams in expected]


# gemma2's paged logits differ from HF's eager ones by ~1e-7 even in float64 (its soft-capped attention):
# enough to move a float32 beam score by an ulp, never a hypothesis
SCORE_REL = {"gemma2": 1e-6}


def generator_for(model, **config):
    return paged_hf.ContinuousBatchGenerator(model, PagedConfig(**{"num_blocks": 256, "block_size": 4, **config}))


def eos_inside_beams(model, prompt, width, max_new):
    """Token ids that HF's beams produce along the way (the best beam's last token, one from the middle of
    the worst): as EOS they end hypotheses inside the search. -> (eos ids, HF's beams without EOS)."""
    beams = hf_beam(model, prompt, width, max_new)
    return sorted({beams[0][0][-1], beams[-1][0][max_new // 2]}), beams


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parity_per_family(family):
    model = tiny_model(family)
    prompts = random_prompts([5, 19, 11])
    generator = generator_for(model)
    expected = [hf_beam(model, p, 4, 8, num_return_sequences=3) for p in prompts]
    got = engine_beam(generator, prompts, BeamSearchParams(beam_width=4, max_tokens=8, num_return_sequences=3,
                                                                   ignore_eos=True))
    assert_same(got, expected, SCORE_REL.get(family, 0.0))
    assert_no_leak(generator)


@pytest.mark.parametrize("width", [2, 5, 8])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (2.0, "never"), (-1.5, True), (0.7, True)])
def test_parity_with_eos_inside_beams(width, length_penalty, early_stopping):
    model = tiny_model("llama", seed=width)
    prompt = random_prompts([7 + width], seed=width)[0]
    eos, without_eos = eos_inside_beams(model, prompt, width, 12)
    kwargs = dict(length_penalty=length_penalty, early_stopping=early_stopping, num_return_sequences=width - 1)
    expected = hf_beam(model, prompt, width, 12, eos=eos, **kwargs)
    assert [tokens for tokens, _ in expected] != [tokens for tokens, _ in without_eos[: width - 1]]  # EOS mattered
    generator = generator_for(model)
    params = BeamSearchParams(beam_width=width, max_tokens=12, stop_token_ids=eos, ignore_eos=True, **kwargs)
    assert engine_beam(generator, [prompt], params)[0] == expected
    assert_no_leak(generator)


def test_width_one_is_greedy_without_eos():
    model = tiny_model("qwen2")
    prompts = random_prompts([6, 21])
    generator = generator_for(model)
    beams = generator.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=9, ignore_eos=True))
    greedy = generator.generate(prompts, SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [b.sequences[0].output_token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]


def test_min_tokens_and_repetition_penalty_follow_hf():
    model = tiny_model("llama", seed=3)
    prompt = random_prompts([9], seed=3)[0]
    eos, _ = eos_inside_beams(model, prompt, 4, 10)
    expected = hf_beam(model, prompt, 4, 10, eos=eos, min_new_tokens=5, repetition_penalty=1.3)
    params = BeamSearchParams(beam_width=4, max_tokens=10, stop_token_ids=eos, ignore_eos=True, min_tokens=5,
                              repetition_penalty=1.3)
    assert engine_beam(generator_for(model), [prompt], params)[0] == expected


def test_model_eos_and_ignore_eos():
    model = tiny_model("llama", seed=5)
    prompt = random_prompts([8], seed=5)[0]
    eos, _ = eos_inside_beams(model, prompt, 3, 10)
    model.generation_config.eos_token_id = eos[0]
    generator = generator_for(model)  # the engine reads the model's EOS when it is built
    assert engine_beam(generator, [prompt], BeamSearchParams(beam_width=3, max_tokens=10))[0] == \
        hf_beam(model, prompt, 3, 10, eos=[eos[0]])
    assert engine_beam(generator, [prompt], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))[0] == \
        hf_beam(model, prompt, 3, 10)


def test_beams_share_steps_with_other_requests_chunked_and_preempted():
    """Beam searches and sampled requests in the same steps, prompts chunked, a pool small enough to preempt:
    the hypotheses do not change."""
    model = tiny_model("mistral_window")
    prompts = random_prompts([23, 30, 9], seed=7)
    params = BeamSearchParams(beam_width=4, max_tokens=14, length_penalty=0.5, ignore_eos=True)
    expected = [hf_beam(model, p, 4, 14, length_penalty=0.5) for p in prompts]
    generator = generator_for(model, num_blocks=40, max_num_batched_tokens=16)
    beam_ids = [generator.add_beam_request(p, params) for p in prompts]
    others = [generator.add_request(p, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
              for p in random_prompts([17, 25, 12], seed=8)]
    finished, mixed_steps = {}, 0
    while generator.has_unfinished_requests():
        running = {r.request_id for r in generator.scheduler.running}
        mixed_steps += bool(running & set(beam_ids)) and bool(running & set(others))
        for output in generator.step():
            if output.finished:
                finished[output.request_id] = output
    assert mixed_steps > 0 and generator.stats()["num_preemptions"] > 0
    got = [[o.token_ids for o in finished[r].outputs] for r in beam_ids]
    assert got == [[tokens for tokens, _ in e] for e in expected]
    assert all(o.finish_reason == "length" for r in beam_ids for o in finished[r].outputs)
    assert_no_leak(generator)


@pytest.mark.parametrize("caching,num_blocks", [(True, 20), (False, 40)])
def test_beam_searches_in_a_pool_that_holds_about_one(caching, num_blocks):
    """Beams that wait for their siblings hold blocks; when nothing else can run they give them back (and
    recompute later) instead of waiting forever. Nothing changes, nothing leaks."""
    model = tiny_model("llama")
    prompts = random_prompts([21, 14, 30], seed=3)
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    expected = [[tokens for tokens, _ in hf_beam(model, p, 4, 10)] for p in prompts]
    generator = generator_for(model, num_blocks=num_blocks, enable_prefix_caching=caching, max_num_batched_tokens=64)
    beam_ids = [generator.add_beam_request(p, params) for p in prompts]
    for prompt in prompts[:2]:
        generator.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    finished = {}
    while generator.has_unfinished_requests():
        finished.update((o.request_id, o) for o in generator.step() if o.finished)
    assert [[c.token_ids for c in finished[r].outputs] for r in beam_ids] == expected
    assert generator.stats()["num_preemptions"] > 0
    assert_no_leak(generator)


def test_width_8_over_500_tokens_holds_the_prompt_once():
    """The prompt's blocks are shared by all 8 beams (ref counts); each beam only adds its tail."""
    model = tiny_model("llama")
    prompt = random_prompts([500])[0]
    block_size, max_new = 16, 12
    generator = generator_for(model, block_size=block_size, num_blocks=400, max_num_batched_tokens=512)
    generator.add_beam_request(prompt, BeamSearchParams(beam_width=8, max_tokens=max_new, ignore_eos=True))
    peak = 0
    while generator.has_unfinished_requests():
        generator.step()
        stats = generator.stats()
        peak = max(peak, stats["num_blocks"] - stats["num_free_blocks"])
    prompt_blocks = -(-len(prompt) // block_size)
    per_beam = -(-(len(prompt) % block_size + max_new) // block_size)  # its copy of the partial block onwards
    assert peak <= prompt_blocks + 8 * per_beam, (peak, prompt_blocks, per_beam)  # HF: 8 * (prompt + tail)
    assert peak < 2 * prompt_blocks
    assert generator.kv_cache_manager.num_block_copies > 0  # copy-on-write of shared partial blocks
    assert_no_leak(generator)


def test_abort_frees_every_beam():
    model = tiny_model("llama")
    generator = generator_for(model)
    request_id = generator.add_beam_request(random_prompts([12])[0], BeamSearchParams(beam_width=5, max_tokens=30))
    for _ in range(4):
        generator.step()
    generator.abort(request_id)
    outputs = generator.step()
    assert [o.request_id for o in outputs] == [request_id]
    assert outputs[0].finished and {c.finish_reason for c in outputs[0].outputs} == {"abort"}
    assert_no_leak(generator)


@pytest.mark.parametrize("field,value", [("beam_width", 0), ("max_tokens", 0), ("length_penalty", "x"),
                                         ("early_stopping", "sometimes"), ("num_return_sequences", 5),
                                         ("min_tokens", 99), ("repetition_penalty", 0.0), ("stop_token_ids", [-1])])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{"beam_width": 4, "max_tokens": 10, field: value})


def test_requests_the_engine_cannot_hold_are_refused():
    model = tiny_model("llama")
    generator = generator_for(model, num_blocks=20, max_num_seqs=4)
    prompt = random_prompts([30])[0]
    with pytest.raises(ValueError, match="max_num_seqs"):
        generator.add_beam_request(prompt, BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="KV blocks"):
        generator.add_beam_request(prompt, BeamSearchParams(beam_width=4, max_tokens=40))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        generator.add_beam_request(prompt, SamplingParams())
    assert_no_leak(generator)


@pytest.mark.slow
def test_real_model_in_float32_matches_hf_beam_search(loaded):
    """SmolLM2 in float32, its own EOS: the same hypotheses as HF's beam search, scores to float32 noise (the
    paged kernels sum in another order than HF's attention)."""
    model, tokenizer = loaded
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)]
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    expected = [hf_beam(model, p, 4, 14, eos=eos, num_return_sequences=3, length_penalty=1.2) for p in prompts]
    generator = paged_hf.wrap(model, tokenizer, num_blocks=64, max_num_batched_tokens=64).generator
    params = BeamSearchParams(beam_width=4, max_tokens=14, num_return_sequences=3, length_penalty=1.2)
    outputs = generator.beam_search(prompts, params)
    assert_same([[(s.output_token_ids, s.score) for s in o.sequences] for o in outputs], expected, rel=1e-5)
    assert "Paris" in outputs[0].sequences[0].text
    assert_no_leak(generator)
