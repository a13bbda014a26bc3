"""Gemma 3's images beyond test_images.py's checks: its image tokens attend to each other (HF's `token_type_ids`
mask), so a prefill chunk is cut before an image it would cut through, an image longer than the token budget is
refused at submission, a step through an image runs on the torch kernel with the image's span in its metadata (the
others on the kernel selected for the model), and the tiny model tells a bidirectional mask from a causal one (so the
equality checks would see an engine that masked causally)."""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import EncoderCalls, hf_generate, random_image, tiny_gemma3

import paged_hf
from paged_hf import SamplingParams

MAX_NEW = 6
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, logprobs=5, ignore_eos=True)
TEXT = "USER: the image <image> is it hot or cold ASSISTANT:"  # its image's 4 tokens are positions 4..7


@pytest.fixture(scope="module")
def gemma3():
    return tiny_gemma3()


def _prompt(seed: int = 2, text: str = TEXT):
    return {"prompt": text, "multi_modal_data": {"image": [random_image(seed)]}}


def _check_equal_hf(model, processor, output, seed: int = 2, text: str = TEXT):
    tokens, top = hf_generate(model, processor, text, [random_image(seed)], MAX_NEW)
    assert output.outputs[0].token_ids == tokens
    for theirs, ours in zip(top, output.outputs[0].logprobs):
        for token_id, value in theirs.items():
            assert abs(ours[token_id] - value) < 1e-6


def test_the_tiny_model_tells_the_image_mask_from_a_causal_one(gemma3):
    model, processor = gemma3
    inputs = processor(text=TEXT, images=[random_image(2)], return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.float64)
    assert inputs["token_type_ids"][0].tolist() == [0] * 4 + [1] * 4 + [0] * 7
    bidirectional = torch.log_softmax(model(**inputs).logits[0, -1], -1)
    inputs.pop("token_type_ids")  # HF's forward then masks causally
    causal = torch.log_softmax(model(**inputs).logits[0, -1], -1)
    assert (bidirectional - causal).abs().max() > 1e-3  # far over the 1e-6 the equality checks allow


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_chunk_that_would_end_inside_an_image_is_cut_before_it(gemma3, policy):
    gen = paged_hf.wrap(*gemma3, block_size=4, num_blocks=64, max_num_batched_tokens=6,
                        scheduling_policy=policy).generator
    gen.add_request(_prompt(), PARAMS)
    gen.step()  # 6 tokens would end inside the image (4..7): the chunk stops before it
    assert gen.scheduler.running[0].num_computed_tokens == 4
    gen.step()  # the image and the text after it, 6 tokens
    assert gen.scheduler.running[0].num_computed_tokens == 10
    outputs = []
    while gen.has_unfinished_requests():
        outputs += [output for output in gen.step() if output.finished]
    _check_equal_hf(*gemma3, outputs[0])


def test_a_waiting_image_that_does_not_fit_the_step_waits_for_the_next(gemma3):
    gen = paged_hf.wrap(*gemma3, block_size=4, num_blocks=64, max_num_batched_tokens=6).generator
    text = "USER: <image> what ASSISTANT:"  # its image at 2..5: a chunk of at most 2 tokens would stop before it
    first = gen.add_request({"prompt": "USER: tell me of the water ASSISTANT:"}, PARAMS)  # 7 text tokens
    second = gen.add_request(_prompt(3, text), PARAMS)
    gen.step()  # the text prompt takes 6 tokens; the image prompt would get 0 up to its image: it waits
    assert [r.request_id for r in gen.scheduler.running] == [first] and len(gen.scheduler.waiting) == 1
    outputs = {}
    while gen.has_unfinished_requests():
        outputs |= {output.request_id: output for output in gen.step() if output.finished}
    _check_equal_hf(*gemma3, outputs[second], 3, text)


def test_an_image_longer_than_the_token_budget_is_refused_at_submission(gemma3):
    gen = paged_hf.wrap(*gemma3, block_size=4, num_blocks=64, max_num_batched_tokens=3).generator
    with pytest.raises(ValueError, match="image of 4 tokens .* max_num_batched_tokens is 3"):
        gen.add_request(_prompt(), PARAMS)
    assert not gen.has_unfinished_requests()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_step_through_an_image_runs_on_the_torch_kernel_with_its_span(gemma3, backend):
    model, processor = gemma3
    gen = paged_hf.wrap(model, processor, block_size=4, num_blocks=64, attention_backend=backend).generator
    cache = gen.runner.cache
    assert len(cache.attention_layers) == 2 and all(spec.bidirectional_spans for spec in cache.attention_layers)
    # auto: the compiled CPU kernel (where it builds) for the model's steps, the torch kernel for those with spans
    assert (cache.span_kernel is None) == (gen.runner.kernel.name == "torch")
    seen = []
    begin_step = cache.begin_step

    def record(metadata):
        begin_step(metadata)
        seen.append((cache.step_kernel.name, metadata.bidirectional))

    cache.begin_step = record
    try:
        outputs = gen.generate([_prompt(), {"prompt": "USER: hot ASSISTANT:"}], PARAMS, use_tqdm=False)
    finally:
        del cache.begin_step
    assert seen[0] == ("torch", [((4, 8),), ()])  # the prefill step names the image's span, the text request none
    assert all(spans is None and name == gen.runner.kernel.name for name, spans in seen[1:])  # decodes: none
    _check_equal_hf(model, processor, outputs[0])


def test_expanded_token_ids_are_served_and_one_token_per_image_is_refused(gemma3):
    model, processor = gemma3
    gen = paged_hf.wrap(model, processor, block_size=4, num_blocks=64).generator
    images = [random_image(2)]
    expanded = processor(text=TEXT, images=images)["input_ids"][0]
    calls = EncoderCalls(model)
    try:
        by_ids = gen.generate({"prompt_token_ids": list(expanded), "multi_modal_data": {"image": images}}, PARAMS,
                              use_tqdm=False)
    finally:
        calls.handle.remove()
    assert calls.count == 1
    _check_equal_hf(model, processor, by_ids[0])
    with pytest.raises(ValueError, match="expanded ids"):
        gen.add_request({"prompt_token_ids": [7, 4, 8], "multi_modal_data": {"image": images}}, PARAMS)
    with pytest.raises(ValueError, match="ends inside an image"):
        gen.add_request({"prompt_token_ids": list(expanded[:8]), "multi_modal_data": {"image": images}}, PARAMS)
