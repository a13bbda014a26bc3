"""Bad input gets a ValueError naming the value and changes nothing; failures inside the model leak nothing."""

from __future__ import annotations

import pytest
from conftest import VOCAB, assert_no_leak, hf_greedy, random_prompts

import paged_hf
from paged_hf import PagedConfig, SamplingParams


@pytest.fixture
def generator(llama):
    return paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=16, block_size=4, max_model_len=100))


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 0), ("min_new_tokens", -1), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 2.0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -3.0), ("n", 0), ("seed", "x"), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logprobs", -1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("repetition_penalty", float("inf")),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    ([1, 2, VOCAB], str(VOCAB)),
    ([1, -1], "-1"),
    ("text without tokenizer", "tokenizer"),
    ([1.5, 2], "token ids"),
])
def test_bad_prompts_are_rejected_and_nothing_is_queued(generator, prompt, message):
    with pytest.raises(ValueError, match=message):
        generator.add_request(prompt, SamplingParams(max_new_tokens=2))
    assert not generator.has_unfinished_requests()
    assert_no_leak(generator)


def test_too_long_and_never_fitting_requests_are_rejected(generator):
    with pytest.raises(ValueError, match="max_model_len=100"):
        generator.add_request([1] * 90, SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="KV blocks"):  # 16 blocks of 4 = 64 tokens, below max_model_len
        generator.add_request([1] * 60, SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="adapter"):
        generator.add_request([1, 2], SamplingParams(max_new_tokens=2), adapter="nope")
    with pytest.raises(ValueError, match="sampling_params"):
        generator.add_request([1, 2], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="tokenizer"):  # stop strings are matched on text
        generator.add_request([1, 2], SamplingParams(max_new_tokens=2, stop=["x"]))
    assert not generator.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_queues_nothing_of_that_batch(generator):
    with pytest.raises(ValueError):
        generator.generate([[1, 2, 3], []], SamplingParams(max_new_tokens=2), use_tqdm=False)
    assert not generator.has_unfinished_requests()
    assert_no_leak(generator)


def test_duplicate_request_id_is_rejected(generator):
    generator.add_request([1, 2], SamplingParams(max_new_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="'a'"):
        generator.add_request([1, 2], SamplingParams(max_new_tokens=2), request_id="a")
    generator.abort("a")
    assert_no_leak(generator)


def test_exception_inside_the_model_aborts_the_call_and_leaves_the_generator_usable(llama):
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=32, block_size=4))
    prompts = random_prompts([8, 12, 5])
    calls = {"n": 0}

    def explode(module, args):
        calls["n"] += 1
        if calls["n"] == 3:  # fail mid-generation, after some blocks are in use
            raise RuntimeError("boom")

    handle = llama.model.layers[1].register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        generator.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0), use_tqdm=False)
    handle.remove()
    assert_no_leak(generator)
    assert not generator.has_unfinished_requests()
    [out] = generator.generate(prompts[:1], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(llama, prompts[0], 5)
    assert_no_leak(generator)


def test_abort_frees_blocks_at_once_and_reports_abort(llama):
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=32, block_size=4))
    keep = generator.add_request(random_prompts([9])[0], SamplingParams(max_new_tokens=6, temperature=0))
    drop = generator.add_request(random_prompts([20], seed=1)[0], SamplingParams(max_new_tokens=30, temperature=0))
    generator.step()
    generator.step()
    used_before = generator.stats()["num_blocks"] - generator.stats()["num_free_blocks"]
    generator.abort(drop)
    used_after = generator.stats()["num_blocks"] - generator.stats()["num_free_blocks"]
    assert used_after < used_before
    finals = {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals[drop].outputs[0].finish_reason == "abort"
    assert finals[keep].outputs[0].finish_reason == "length"
    assert_no_leak(generator)


def test_unknown_config_field_is_rejected(llama):
    with pytest.raises(ValueError, match="blok_size"):
        paged_hf.wrap(llama, blok_size=4)


def test_abort_of_a_waiting_request_and_unknown_id(generator):
    request_id = generator.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    generator.abort(request_id)
    generator.abort("never-existed")
    outputs = generator.step()
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort"]
    assert not generator.has_unfinished_requests()
    assert_no_leak(generator)


def test_stop_lists_are_bounded_by_the_config(llama):
    from tiny_server import tiny_tokenizer  # noqa: PLC0415

    config = PagedConfig(num_blocks=16, block_size=4, max_stop_strings=3, max_stop_string_chars=5)
    generator = paged_hf.ContinuousBatchGenerator(llama, config, tiny_tokenizer())
    with pytest.raises(ValueError, match="4 strings; at most max_stop_strings=3"):
        generator.add_request([1, 2], SamplingParams(max_new_tokens=2, stop=["a", "b", "c", "d"]))
    with pytest.raises(ValueError, match="6 characters; at most max_stop_string_chars=5"):
        generator.add_request([1, 2], SamplingParams(max_new_tokens=2, stop=["abcdef"]))
    assert not generator.has_unfinished_requests()
    generator.add_request([1, 2], SamplingParams(max_new_tokens=2, stop=["a", "b", "abcde"]))
    assert generator.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_stop_strings"):
        PagedConfig(max_stop_strings=0)
    assert PagedConfig().max_stop_strings == 64 and PagedConfig().max_stop_string_chars == 512


def test_logprobs_are_bounded_by_max_logprobs(llama):
    """vLLM's max_logprobs (20): a request asking for more top logprobs, or prompt logprobs, is refused at
    submission; -1 lifts the limit."""
    generator = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=16, block_size=4, max_logprobs=3))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}=4 is more than max_logprobs=3"):
            generator.add_request([1, 2], SamplingParams(max_new_tokens=2, **{field: 4}))
    assert not generator.has_unfinished_requests()
    generator.add_request([1, 2], SamplingParams(max_new_tokens=2, logprobs=3, prompt_logprobs=3))
    unlimited = paged_hf.ContinuousBatchGenerator(llama, PagedConfig(num_blocks=16, block_size=4, max_logprobs=-1))
    unlimited.add_request([1, 2], SamplingParams(max_new_tokens=2, logprobs=50))
    assert PagedConfig().max_logprobs == 20


def test_a_token_budget_below_max_num_seqs_is_refused():
    """Every running request needs one token of each step's budget, or the tail of the running list starves."""
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 is smaller than max_num_seqs=16"):
        PagedConfig(max_num_batched_tokens=8, max_num_seqs=16)
    assert PagedConfig(max_num_batched_tokens=8).max_num_seqs == 8  # the default follows a small budget
    assert PagedConfig().max_num_seqs == 64 and PagedConfig(max_num_seqs=8, max_num_batched_tokens=8).max_num_seqs == 8
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an int >= 1, got 0"):
        PagedConfig(max_num_batched_tokens=0)
