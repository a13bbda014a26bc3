"""Token-for-token parity with plain HF generate (one prompt at a time) under every scheduling regime."""

from __future__ import annotations

import pytest
from conftest import FAMILIES, assert_no_leak, hf_greedy, random_prompts, tiny_model

import paged_hf
from paged_hf import PagedConfig, SamplingParams

LENGTHS = [5, 17, 33, 40, 9, 26]
MAX_NEW = [8, 20, 3, 12, 15, 6]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


def run_engine(model, prompts, max_new, **config):
    generator = paged_hf.ContinuousBatchGenerator(model, PagedConfig(**config))
    outputs = generator.generate(prompts, [greedy(n) for n in max_new], use_tqdm=False)
    assert_no_leak(generator)
    return [o.outputs[0].token_ids for o in outputs], generator


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_parity_with_hf_per_family(family, backend):
    model = tiny_model(family)
    prompts = random_prompts(LENGTHS)
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    got, generator = run_engine(model, prompts, MAX_NEW, num_blocks=128, block_size=4, max_num_batched_tokens=64,
                                attention_backend=backend)
    assert generator.runner.kernel.name == backend
    assert got == expected


@pytest.mark.parametrize("family", ["llama", "mistral_window", "gpt_neox"])
def test_parity_with_chunked_prefill(family):
    """A token budget far below the prompt lengths: every prompt is split into many chunks."""
    model = tiny_model(family)
    prompts = random_prompts([60, 45, 70, 12])
    max_new = [10, 14, 6, 20]
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    got, _ = run_engine(model, prompts, max_new, num_blocks=128, block_size=4, max_num_batched_tokens=7)
    assert got == expected


def test_parity_under_preemption():
    """A pool far too small for the batch: requests are preempted and recomputed, outputs do not change."""
    model = tiny_model("llama")
    prompts = random_prompts([30, 25, 35, 28, 22, 31])
    max_new = [25, 30, 20, 28, 26, 24]
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    got, generator = run_engine(model, prompts, max_new, num_blocks=16, block_size=4, max_num_batched_tokens=32)
    assert generator.stats()["num_preemptions"] > 0
    assert got == expected


def test_parity_with_prefix_caching_off():
    model = tiny_model("qwen2")
    prompts = random_prompts(LENGTHS)
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    got, _ = run_engine(model, prompts, MAX_NEW, num_blocks=64, block_size=8, max_num_batched_tokens=20,
                        enable_prefix_caching=False)
    assert got == expected


def test_max_num_seqs_limits_the_batch(llama):
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=64, block_size=4, max_num_seqs=2))
    for prompt in random_prompts([5, 6, 7, 8]):
        generator.add_request(prompt, greedy(4))
    seen = 0
    while generator.has_unfinished_requests():
        generator.step()
        assert generator.stats()["num_running"] <= 2
        seen = max(seen, generator.stats()["num_running"])
    assert seen == 2
    assert_no_leak(generator)


def test_step_outputs_are_cumulative_and_streaming_yields_new_tokens(llama):
    prompt = random_prompts([10])[0]
    expected = hf_greedy(llama, prompt, 6)
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=32, block_size=4))
    request_id = generator.add_request(prompt, greedy(6))
    last = None
    while generator.has_unfinished_requests():
        for output in generator.step():
            assert output.request_id == request_id
            if last is not None:
                assert output.outputs[0].token_ids[: len(last)] == last
            last = output.outputs[0].token_ids
    assert last == expected and output.finished and output.outputs[0].finish_reason == "length"
    assert output.metrics.first_token_time is not None and output.metrics.finish_time >= output.metrics.first_token_time
    pieces = list(generator.stream(prompt, greedy(6)))
    assert sum(pieces, []) == expected and all(pieces)
    assert_no_leak(generator)


def test_eos_and_stop_token_ids_end_requests(llama):
    prompt = random_prompts([10])[0]
    free_run = hf_greedy(llama, prompt, 12)
    stop_token = free_run[4]
    first = free_run.index(stop_token)
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=32, block_size=4))
    [by_stop_id, by_eos, ignoring] = generator.generate(
        [prompt] * 3,
        [SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop_token]),
         SamplingParams(max_new_tokens=12, temperature=0, eos_token_ids=[stop_token]),
         SamplingParams(max_new_tokens=12, temperature=0, eos_token_ids=[stop_token], ignore_eos=True)],
        use_tqdm=False,
    )
    assert by_stop_id.outputs[0].token_ids == free_run[: first + 1] and by_stop_id.outputs[0].finish_reason == "stop"
    assert by_eos.outputs[0].token_ids == free_run[: first + 1]
    assert ignoring.outputs[0].token_ids == free_run and ignoring.outputs[0].finish_reason == "length"
    assert_no_leak(generator)
