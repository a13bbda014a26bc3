"""The generator's Python API as a user drives it: request ids, what a prompt is, whose outputs step() returns,
and what leaving a stream() does."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import assert_no_leak, hf_greedy, random_prompts

import paged_hf
from paged_hf import PagedConfig, SamplingParams


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


@pytest.fixture
def generator(llama):
    return paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=32, block_size=4))


def run_to_end(generator) -> dict[str, object]:
    """step() until nothing is left; the last output of each request id."""
    last = {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            last[output.request_id] = output
    return last


def test_a_request_id_can_be_reused_after_abort(generator, llama):
    first, second = random_prompts([5, 6])
    generator.add_request(first, greedy(20), request_id="r")
    generator.step()
    generator.abort("r")
    generator.add_request(second, greedy(4), request_id="r")
    outputs = [output for _ in range(2) for output in generator.step()]
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason == "abort"
    assert outputs[0].prompt_token_ids == first
    last = run_to_end(generator)["r"]
    assert last.prompt_token_ids == second and last.outputs[0].token_ids == hf_greedy(llama, second, 4)
    assert_no_leak(generator)


@pytest.mark.parametrize("as_text", [False, True])
def test_a_single_prompt_is_one_request(llama, as_text):
    from tiny_server import tiny_tokenizer  # noqa: PLC0415

    tokenizer = tiny_tokenizer()
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=32, block_size=4), tokenizer)
    prompt = "the cat of the day" if as_text else random_prompts([5])[0]
    ids = tokenizer(prompt)["input_ids"] if as_text else prompt
    outputs = generator.generate(prompt, greedy(3), use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].prompt_token_ids == ids
    assert outputs[0].outputs[0].token_ids == hf_greedy(llama, ids, 3)
    assert len(generator.generate(torch.tensor(ids), greedy(3), use_tqdm=False)) == 1
    assert len(generator.generate([prompt, prompt], greedy(3), use_tqdm=False)) == 2


def test_outputs_of_other_requests_survive_generate_and_stream(generator, llama):
    """Requests queued with add_request that finish while generate() or stream() steps the engine still
    reach the next step(), finished, with their tokens; the calls' own requests never show up there."""
    short, other, mine = random_prompts([4, 5, 6])
    generator.add_request(short, greedy(2), request_id="short")
    generator.generate([mine], greedy(6), use_tqdm=False)
    generator.add_request(other, greedy(2), request_id="other")
    assert sum(generator.stream(mine, greedy(6)), []) == hf_greedy(llama, mine, 6)
    assert generator.has_unfinished_requests()
    last = run_to_end(generator)
    assert set(last) == {"short", "other"}
    assert last["short"].finished and last["short"].outputs[0].token_ids == hf_greedy(llama, short, 2)
    assert last["other"].finished and last["other"].outputs[0].token_ids == hf_greedy(llama, other, 2)
    assert_no_leak(generator)


def test_break_out_of_a_stream_ends_its_request_at_once(generator):
    for tokens in generator.stream(random_prompts([6])[0], greedy(20)):
        break
    assert tokens and not generator.has_unfinished_requests()
    assert generator.step() == []
    assert_no_leak(generator)


def test_a_kept_stream_is_closed_explicitly_or_by_its_with_block(generator):
    prompt = random_prompts([6])[0]
    stream = generator.stream(prompt, greedy(20))
    next(stream)
    assert generator.has_unfinished_requests()  # held: its request runs on until closed
    stream.close()
    assert not generator.has_unfinished_requests() and list(stream) == []
    with generator.stream(prompt, greedy(20)) as stream:
        next(stream)
    assert not generator.has_unfinished_requests()
    generator.stream(prompt, greedy(20))  # never iterated and dropped: nothing stays queued
    gc.collect()
    assert not generator.has_unfinished_requests()
    assert_no_leak(generator)


def test_stream_rejects_bad_input_when_called(generator):
    with pytest.raises(ValueError, match="n=1"):
        generator.stream([1, 2, 3], SamplingParams(n=2))
    with pytest.raises(ValueError, match="empty"):
        generator.stream([], greedy(2))
    assert not generator.has_unfinished_requests()


def test_a_stream_closed_inside_a_step_is_aborted_after_that_step(generator, llama):
    """A finalizer (a dropped stream collected by the garbage collector) can run in the middle of a step; its
    abort waits for the step's end instead of changing the scheduler under it."""
    prompt, other = random_prompts([6, 7])
    streams = [generator.stream(prompt, greedy(20))]
    next(streams[0])
    generator.add_request(other, greedy(4), request_id="other")

    def close_mid_step(module, args):
        if streams:
            streams.pop().close()

    handle = generator.runner.model.register_forward_pre_hook(close_mid_step)
    try:
        last = run_to_end(generator)
    finally:
        handle.remove()
    assert set(last) == {"other"} and last["other"].outputs[0].token_ids == hf_greedy(llama, other, 4)
    assert_no_leak(generator)
