"""Speculative decoding (n-gram prompt lookup): outputs are exactly those without it.

Greedy: token for token against plain transformers generate (float64 tiny models of every family), also
under chunked prefill, preemption and prefix caching. Seeded sampling: the same tokens as the same engine
without speculation (the verifier keeps the sampler's own draws). Unseeded sampling: the distribution of the
first tokens matches the model's exact probabilities (chi-square). Prompts repeat themselves, so prompt
lookup finds drafts, and every test checks that drafts were accepted (otherwise it could not fail).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import FAMILIES, assert_no_leak, hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import PagedConfig, SamplingParams
from paged_hf.spec_decode import NgramProposer, SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repeating_prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Prompts that restate themselves: what prompt lookup serves."""
    return [p + p[: len(p) // 2] + p for p in random_prompts(lengths, seed)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


def run(model, prompts, params, speculative=SPEC, **config):
    generator = paged_hf.wrap(model, speculative=speculative, **config).generator
    outputs = generator.generate(prompts, params, use_tqdm=False)
    assert_no_leak(generator)
    return outputs, generator.stats()


# --- the proposer and the config -------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(1, 3)  # no spec factor: always up to k
    assert proposer.propose([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3, 4], 2) == [7, 2]  # 3-gram, latest of two
    assert proposer.propose([5, 8, 9, 1, 3, 9, 2, 5, 8, 9], 2) == [1, 3]  # the longest match, not the latest 1-gram
    assert proposer.propose([5, 6, 7, 8, 1, 9, 1], 3) == [9, 1]  # only a 1-gram matches; what is left
    assert proposer.propose([1, 2, 3], 4) == []  # no match
    assert NgramProposer(2, 2).propose([1, 2, 9, 3, 2], 4) == []  # a 1-gram match is below min
    assert NgramProposer(1, 2).propose([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3, 4], 1) == [7]  # max caps n, not k
    assert proposer.propose([4, 4, 4, 4], 0) == []


def test_ngram_spec_factor_drafts_fewer_tokens_for_shorter_matches():
    three = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3, 4]  # its last 3 tokens match
    one = [5, 6, 7, 8, 1, 9, 2, 1]  # only its last token matches
    assert NgramProposer(1, 3, spec_factor=1.0).propose(three, 8) == [7, 2, 3]  # n = 3: 3 drafts
    assert NgramProposer(1, 3, spec_factor=0.5).propose(three, 8) == [7, 2]  # ceil(1.5)
    assert NgramProposer(1, 3, spec_factor=2.0).propose(three, 4) == [7, 2, 3, 4]  # k still caps
    assert NgramProposer(1, 3, spec_factor=1.0).propose(one, 8) == [9]  # n = 1: 1 draft
    assert NgramProposer(1, 3, spec_factor=2.0).propose(one, 8) == [9, 2]


def test_config_parsing_and_errors():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 4, 4)
    assert SpeculativeConfig().prompt_lookup_min == 5  # vLLM's defaults
    assert SpeculativeConfig().prompt_lookup_spec_factor == 2.0
    assert SpeculativeConfig.parse('{"prompt_lookup_spec_factor": null}').prompt_lookup_spec_factor is None
    assert PagedConfig(speculative={"num_speculative_tokens": 2}).speculative.num_speculative_tokens == 2
    for bad, match in [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"prompt_lookup_spec_factor": 0}, "prompt_lookup_spec_factor"),
                       ({"prompt_lookup_spec_factor": "2"}, "prompt_lookup_spec_factor"),
                       ({"k": 2}, "unknown"), ("{not json", "JSON"), ([1], "dict")]:
        with pytest.raises(ValueError, match=match):
            PagedConfig(speculative=bad)


def test_policy_spreads_drafts_over_the_verify_budget():
    generator = paged_hf.wrap(tiny_model("llama"), speculative={**SPEC, "max_verify_tokens": 16}).generator
    speculator = generator.speculator
    decoding = [type("R", (), {"num_tokens_to_compute": 1})() for _ in range(8)]
    assert speculator.num_drafts_per_request(decoding[:1], 1, 512) == 4  # capped by k
    assert speculator.num_drafts_per_request(decoding[:4], 4, 512) == 3  # 16 // 4 - 1
    assert speculator.num_drafts_per_request(decoding, 8, 512) == 1
    prefill = type("R", (), {"num_tokens_to_compute": 100})()
    assert speculator.num_drafts_per_request(decoding[:2] + [prefill], 2, 512) == 0  # the step is full already


# --- greedy: token for token -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_parity_every_family(family):
    model = tiny_model(family)
    prompts = repeating_prompts([9, 21, 30], seed=3)
    expected = [hf_greedy(model, p, 20) for p in prompts]
    outputs, stats = run(model, prompts, greedy(20), num_blocks=64)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats


def test_greedy_parity_under_chunked_prefill_preemption_and_prefix_hits():
    """A pool too small for the batch (preemption), 16-token chunks, and prompts sharing blocks: blocks of
    rejected drafts go back, and no block holding an unverified token is ever hashed."""
    model = tiny_model("llama")
    a, b, c, d = repeating_prompts([30, 41, 25, 33], seed=5)
    prompts = [a, b, a[:32] + [7, 8, 9] * 4, c, d, b[:32] + [9, 8] * 6]  # prefix hits on a and b
    expected = [hf_greedy(model, p, 24) for p in prompts]
    generator = paged_hf.wrap(model, speculative=SPEC, num_blocks=40, block_size=4, max_num_batched_tokens=16,
                              max_num_seqs=4).generator
    assert step_to_completion(generator, prompts, greedy(24), _check_only_verified_blocks_hashed) == expected
    stats = generator.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"], stats  # rollbacks
    assert_no_leak(generator)


def step_to_completion(generator, prompts, params, check) -> list[list[int]]:
    """Run the prompts through step(), calling check(generator, request) on every running request after
    each step -> each prompt's tokens."""
    for prompt in prompts:
        generator.add_request(prompt, params)
    finished = {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0].token_ids
        for request in generator.scheduler.running:
            check(generator, request)
    return [finished[i] for i in range(len(prompts))]


def _check_only_verified_blocks_hashed(generator, request):
    size = generator.config.block_size
    blocks = generator.block_pool.blocks
    hashed = [i for i, block_id in enumerate(request.block_ids) if blocks[block_id].block_hash is not None]
    assert all(i < request.num_computed_tokens // size for i in hashed), (request.request_id, hashed)
    assert len(request.block_ids) <= -(-request.num_tokens // size), "blocks of rejected drafts kept"


def test_stop_tokens_max_tokens_and_n():
    """A stop token inside accepted drafts ends the request there; n > 1 children speculate each."""
    model = tiny_model("llama")
    prompts = repeating_prompts([24, 31], seed=2)
    plain = paged_hf.wrap(model, num_blocks=64).generator.generate(prompts, greedy(20), use_tqdm=False)
    stops = [o.outputs[0].token_ids[9] for o in plain]
    params = [SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop]) for stop in stops]
    params[1] = SamplingParams(max_new_tokens=13, temperature=0, n=3)
    expected = paged_hf.wrap(model, num_blocks=64).generator.generate(prompts, params, use_tqdm=False)
    outputs, stats = run(model, prompts, params, num_blocks=64)
    for got, want in zip(outputs, expected):
        assert [(c.token_ids, c.finish_reason) for c in got.outputs] == [(c.token_ids, c.finish_reason) for c in want.outputs]
    assert len(outputs[1].outputs) == 3 and len(outputs[1].outputs[0].token_ids) == 13
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats


# --- sampling: the same draws, the same distribution -----------------------------------------------------------

def test_seeded_sampling_gives_the_tokens_and_logprobs_of_the_plain_engine():
    model = tiny_model("llama")
    prompts = repeating_prompts([20, 33], seed=1)
    params = [SamplingParams(max_new_tokens=24, temperature=0.1, seed=7, top_k=20, top_p=0.9, repetition_penalty=1.05,
                             logprobs=2, n=2),
              SamplingParams(max_new_tokens=24, temperature=0.2, seed=3, presence_penalty=0.2, min_new_tokens=5)]
    expected = paged_hf.wrap(model, num_blocks=64).generator.generate(prompts, params, use_tqdm=False)
    outputs, stats = run(model, prompts, params, num_blocks=64)
    for got, want in zip(outputs, expected):
        for c, w in zip(got.outputs, want.outputs):
            assert c.token_ids == w.token_ids
            if w.logprobs is not None:
                assert [sorted(e) for e in c.logprobs] == [sorted(e) for e in w.logprobs]
                assert all(math.isclose(e[t], f[t], abs_tol=1e-9) for e, f in zip(c.logprobs, w.logprobs) for t in e)
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats


def six_token_model() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    return model


def two_token_chi_square(model, speculative: dict, num_samples: int = 3000, budget: int = 8192):
    """-> (chi-square of `num_samples` unseeded (token 1, token 2) samples of one prompt, all in one batch,
    against their exact probabilities; the engine's stats). 35 degrees of freedom."""
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3]
    outputs, stats = run(model, [prompt], SamplingParams(max_new_tokens=2, temperature=1.0, n=num_samples, ignore_eos=True),
                         speculative={**speculative, "max_verify_tokens": budget},
                         max_num_seqs=num_samples, max_num_batched_tokens=budget, num_blocks=num_samples + 8)
    counts = torch.zeros(6, 6, dtype=torch.float64)
    for completion in outputs[0].outputs:
        counts[tuple(completion.token_ids)] += 1
    with torch.no_grad():  # exact p(t1, t2) = p(t1) p(t2 | t1)
        first = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        second = model(torch.tensor([prompt + [t] for t in range(6)])).logits[:, -1].softmax(-1)
    expected = (first[:, None] * second) * num_samples  # [6, 6]
    return float(((counts - expected) ** 2 / expected).sum()), stats


def test_sampled_distribution_matches_the_model():
    """Unseeded samples of (token 1, token 2) with speculation against their exact probabilities: a
    chi-square test on a vocabulary of 6, where prompt lookup proposes (and gets rejected) constantly:
    each child drafts its first token (from "2 3" -> 4)."""
    chi2, stats = two_token_chi_square(six_token_model(), {**SPEC, "num_speculative_tokens": 1})
    assert chi2 < 66.6, (chi2, stats)  # 35 degrees of freedom: the 0.999 quantile is ~66.6
    assert stats["spec_decode_num_draft_tokens"] == 3000, stats
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats


# --- LoRA, stop strings, the real model --------------------------------------------------------------------

def test_lora_requests_speculate_with_their_adapter(tmp_path):
    from conftest import LORA_CONFIGS as CONFIGS
    from conftest import make_adapter

    base = tiny_model("llama")
    oracle = make_adapter(base, tmp_path / "qv", seed=1, **CONFIGS["qv"])
    prompts = repeating_prompts([20, 27], seed=4)
    expected = [hf_greedy(oracle, prompts[0], 16), hf_greedy(base, prompts[1], 16)]
    generator = paged_hf.wrap(base, speculative=SPEC, num_blocks=64, adapters={"qv": str(tmp_path / "qv")}).generator
    outputs = generator.generate(prompts, greedy(16), adapters=["qv", None], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert generator.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leak(generator)


def test_stop_strings_end_inside_accepted_drafts():
    """Over a real vocabulary, a random model rarely repeats anything; without attention output it is a
    bigram model, so its text from a prompt's first token is known, and a prompt holding it is looked up."""
    from conftest import real_tokenizer, tiny_model_for

    tokenizer = real_tokenizer()
    model = tiny_model_for(tokenizer)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    plain = paged_hf.wrap(model, tokenizer, num_blocks=64).generator
    first = tokenizer.encode(" hello")
    chain = plain.generate([first], greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    prompt = first + chain[:20] + first
    text = tokenizer.decode(chain)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(max_new_tokens=24, temperature=0, stop=[stop], logprobs=1)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    generator = paged_hf.wrap(model, tokenizer, speculative=SPEC, num_blocks=64).generator
    got = generator.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (want.text, want.token_ids, "stop", stop)
    assert [sorted(e) for e in got.logprobs] == [sorted(e) for e in want.logprobs]
    assert generator.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_real_model_float32_greedy_is_unchanged(loaded):
    """The default model restating a text: drafts are mostly accepted, and the tokens are HF's."""
    model, tokenizer = loaded
    text = "The quick brown fox jumps over the lazy dog near the river bank at dawn."
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {text}"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    generator = paged_hf.wrap(model, tokenizer, speculative=SPEC, num_blocks=64).generator
    output = generator.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == expected
    stats = generator.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 8, stats


def test_server_metrics_carry_the_spec_decode_counters():
    from paged_hf.serving.openai.metrics import ServerMetrics
    from paged_hf.serving.openai.vllm_metrics import vllm_aliases

    model = tiny_model("llama")
    generator = paged_hf.wrap(model, speculative=SPEC, num_blocks=64).generator
    generator.generate(repeating_prompts([20], seed=1), greedy(12), use_tqdm=False)
    stats = generator.stats()
    text = ServerMetrics().render(stats, 0)
    text += vllm_aliases(text, "tiny")
    accepted = stats["spec_decode_num_accepted_tokens"]
    assert accepted > 0 and sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == accepted
    assert f"paged_hf_spec_decode_num_accepted_tokens_total {accepted}" in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {accepted}' in text
    first = stats["spec_decode_num_accepted_tokens_per_pos"][0]
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="0"}} {first}' in text
    assert "spec_decode" not in ServerMetrics().render(paged_hf.wrap(model, num_blocks=8).generator.stats(), 0)


def test_grounded_bench_runs_the_same_engine_with_and_without_speculation():
    from conftest import real_tokenizer, tiny_model_for

    from paged_hf.bench import parse_systems, sized_engine_config
    from paged_hf.bench.report import build_report, format_table
    from paged_hf.bench.systems import run_system
    from paged_hf.bench.workloads import build_workload

    tokenizer = real_tokenizer()
    workload = build_workload("grounded", tokenizer, num_requests=3, max_new_tokens_scale=0.1)
    assert all(len(r.prompt_token_ids) > 100 for r in workload.requests)
    assert parse_systems(None, "grounded") == ["paged_hf", "paged_hf_spec"]
    model = tiny_model_for(tokenizer)
    engine = sized_engine_config({}, workload)
    runs = {name: run_system(name, model, tokenizer, workload, engine) for name in ("paged_hf", "paged_hf_spec")}
    assert runs["paged_hf"].extra["engine_config"]["speculative"] is None
    assert runs["paged_hf_spec"].extra["spec_decode"]["spec_decode_num_drafts"] >= 0
    report = build_report(workload, runs, None, {})
    assert report["reference_system"] == "paged_hf"
    assert report["systems"]["paged_hf_spec"]["outputs_vs_reference"]["identical"] == 3
    assert "speculation:" in format_table(report)
