"""Vision-language models on the paged engine (LLaVA, VipLLaVA, LLaVA-NeXT, Idefics3, Gemma 3, Qwen2-VL, Qwen2.5-VL):
images in prompts give HF's own greedy tokens and top-5 logprobs (float64, HF's `generate` on the processor's
outputs, one prompt at a time), batched with text-only requests, with a chunk boundary inside an image (Gemma 3: the
chunk cut before its image instead), with preemption, and through the prefix cache (the same image hits, another
image never does)."""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import (IMAGE_TOKEN_ID, NUM_IMAGE_TOKENS, EncoderCalls, hf_generate, prompt_text, random_image,
                      tiny_gemma3, tiny_idefics3, tiny_llava, tiny_llava_next, tiny_qwen_vl, tiny_vipllava)

import paged_hf
from paged_hf import SamplingParams

MAX_NEW = 6
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, logprobs=5, ignore_eos=True)  # HF: no EOS set
#: (text, image seeds): one image, one in the middle of the text, two images, and a text-only prompt
PROMPTS = [
    ("USER: <image> what is this ASSISTANT:", [1]),
    ("USER: the image <image> is it hot or cold ASSISTANT:", [2]),
    ("USER: <image> and <image> which is more ASSISTANT:", [3, 4]),
    ("USER: tell me of the water ASSISTANT:", []),
]


TINY_VLMS = {"llava": tiny_llava, "vipllava": tiny_vipllava, "llava_next": tiny_llava_next, "idefics3": tiny_idefics3,
             "gemma3": tiny_gemma3, "qwen2_vl": lambda: tiny_qwen_vl("2"), "qwen2_5_vl": lambda: tiny_qwen_vl("2.5")}


@pytest.fixture(scope="module", params=list(TINY_VLMS))
def vlm(request):
    return TINY_VLMS[request.param]()


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


def _blocks_needed(processor, text: str, seeds: list[int]) -> int:
    """KV blocks (of 4 tokens) a prompt and its MAX_NEW tokens take (the last new token is sampled, never computed)."""
    images = [random_image(seed) for seed in seeds]
    num_tokens = len(processor(text=prompt_text(processor, text), images=images or None)["input_ids"][0]) + MAX_NEW - 1
    return -(-num_tokens // 4)


def _prompt(text: str, seeds: list[int], processor=None):
    """The prompt dict of `text` with `<image>` written as the processor's placeholder."""
    images = [random_image(seed) for seed in seeds]
    text = text if processor is None else prompt_text(processor, text)
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def _check_equal_hf(model, processor, outputs, prompts=PROMPTS):
    for (text, seeds), output in zip(prompts, outputs):
        tokens, top = hf_generate(model, processor, text, [random_image(seed) for seed in seeds], MAX_NEW)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, text
        for step, (theirs, ours) in enumerate(zip(top, completion.logprobs)):
            for token_id, value in theirs.items():
                assert abs(ours[token_id] - value) < 1e-6, (text, step, token_id)


def _engine(vlm, **config):
    model, processor = vlm
    return paged_hf.wrap(model, processor, block_size=4, **config).generator


def test_images_batched_with_text_give_hf_tokens_and_logprobs(vlm):
    gen = _engine(vlm, num_blocks=64)
    calls = EncoderCalls(vlm[0])
    try:
        outputs = gen.generate([_prompt(text, seeds, vlm[1]) for text, seeds in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        calls.handle.remove()
    assert calls.count == 4  # each image encoded once
    assert outputs[0].prompt_token_ids.count(IMAGE_TOKEN_ID) > 1  # the processor's expansion
    _check_equal_hf(*vlm, outputs)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids or \
        outputs[0].outputs[0].logprobs != outputs[1].outputs[0].logprobs  # the images matter
    assert gen.stats()["num_free_blocks"] == 64


def test_a_chunk_boundary_inside_an_image_encodes_it_once(vlm):
    gen = _engine(vlm, num_blocks=64, max_num_batched_tokens=8)  # images span chunks (Gemma 3's: cut before them)
    calls = EncoderCalls(vlm[0])
    try:
        outputs = gen.generate([_prompt(text, seeds, vlm[1]) for text, seeds in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        calls.handle.remove()
    assert calls.count == 4
    _check_equal_hf(*vlm, outputs)


def test_preemption_recomputes_images(vlm):
    most = max(_blocks_needed(vlm[1], text, seeds) for text, seeds in PROMPTS)
    gen = _engine(vlm, num_blocks=most + 1, max_num_batched_tokens=16, enable_prefix_caching=False)
    calls = EncoderCalls(vlm[0])
    try:
        outputs = gen.generate([_prompt(text, seeds, vlm[1]) for text, seeds in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        calls.handle.remove()
    assert gen.stats()["num_preemptions"] > 0 and calls.count >= 4
    _check_equal_hf(*vlm, outputs)
    assert gen.stats()["num_free_blocks"] == most + 1


def test_a_request_preempted_after_its_prefill_encodes_its_image_again(vlm):
    prompts = PROMPTS[:2]
    needed = sum(_blocks_needed(vlm[1], text, seeds) for text, seeds in prompts)
    # one block short: one decode preempts (no encoder-output cache: the request's own features are what is tested)
    gen = _engine(vlm, num_blocks=needed - 1, enable_prefix_caching=False, encoder_cache_bytes=0)
    calls = EncoderCalls(vlm[0])
    try:
        outputs = gen.generate([_prompt(text, seeds, vlm[1]) for text, seeds in prompts], PARAMS, use_tqdm=False)
    finally:
        calls.handle.remove()
    assert gen.stats()["num_preemptions"] > 0 and calls.count > 2  # the features were dropped after the prefill
    _check_equal_hf(*vlm, outputs, prompts)


def test_the_same_image_hits_the_prefix_cache_and_another_never_does(vlm):
    gen = _engine(vlm, num_blocks=64)
    calls = EncoderCalls(vlm[0])
    text = PROMPTS[0][0]
    try:
        first = gen.generate([_prompt(text, [1], vlm[1])], PARAMS, use_tqdm=False)
        ids = first[0].prompt_token_ids
        num_hit = (len(ids) - 1) // 4 * 4  # full blocks before the last token
        assert max(p for p, t in enumerate(ids) if t == IMAGE_TOKEN_ID) < num_hit  # the image lies in them
        assert calls.count == 1 and gen.stats()["prefix_cache_hits"] == 0
        again = gen.generate([_prompt(text, [1], vlm[1])], PARAMS, use_tqdm=False)
        assert gen.stats()["prefix_cache_hits"] == num_hit and calls.count == 1  # no vision tower for the hit
        other = gen.generate([_prompt(text, [3], vlm[1])], PARAMS, use_tqdm=False)  # the same tiling, another image
        assert other[0].prompt_token_ids == ids
        assert gen.stats()["prefix_cache_hits"] == num_hit and calls.count == 2  # block 0 already holds the image
    finally:
        calls.handle.remove()
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    _check_equal_hf(*vlm, first + other, [(text, [1]), (text, [3])])


def test_n_children_share_the_images_prompt(vlm):
    gen = _engine(vlm, num_blocks=64)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, logprobs=5, n=2, ignore_eos=True)
    output = gen.generate([_prompt(*PROMPTS[2], vlm[1])], params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == output.outputs[1].token_ids
    _check_equal_hf(*vlm, [output], [PROMPTS[2]])


def test_token_ids_with_one_placeholder_per_image_are_expanded(llava):
    model, processor = llava
    gen = _engine(llava, num_blocks=64)
    text, seeds = PROMPTS[2]
    ids = processor.tokenizer(text)["input_ids"]
    assert ids.count(4) == 2
    images = [random_image(seed) for seed in seeds]
    by_ids = gen.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, PARAMS, use_tqdm=False)
    by_text = gen.generate(_prompt(text, seeds), PARAMS, use_tqdm=False)
    assert by_ids[0].prompt_token_ids == by_text[0].prompt_token_ids
    assert by_ids[0].outputs[0].token_ids == by_text[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "USER: <image> hi", "multi_modal_data": {"video": [1]}}, "only 'image'"),
    ({"prompt": "USER: <image> hi", "multi_modal_data": {"image": []}, "extra": 1}, "'extra'"),
    ({"prompt_token_ids": [5, 4, 4, 6], "multi_modal_data": {"image": [random_image(0)]}}, "2 image tokens"),
    ({"prompt": "USER: hi", "prompt_token_ids": [5]}, "exactly one"),
    ({"prompt": "USER: <image> <image>", "multi_modal_data": {"image": [random_image(0)]}}, "processor refused"),
])
def test_bad_image_prompts_are_refused_at_submission(llava, prompt, message):
    gen = _engine(llava, num_blocks=64)
    with pytest.raises(ValueError, match=message):
        gen.add_request(prompt, PARAMS)
    assert not gen.has_unfinished_requests()


def test_images_need_the_processor(llava):
    model, processor = llava
    gen = paged_hf.wrap(model, processor.tokenizer, block_size=4, num_blocks=64).generator
    with pytest.raises(ValueError, match="needs the model's processor"):
        gen.add_request(_prompt(*PROMPTS[0]), PARAMS)
    with pytest.raises(ValueError, match="needs the model's processor"):  # beam search takes prompt dicts too
        gen.beam_search([_prompt(*PROMPTS[0])], paged_hf.BeamSearchParams(beam_width=2, max_tokens=2))


def _other_llava():
    import transformers

    class OtherLlava(transformers.LlavaForConditionalGeneration):  # its forward may merge images otherwise
        pass

    return tiny_llava(model_class=OtherLlava)[0]


@pytest.mark.parametrize("make, message", [
    (_other_llava, "OtherLlava is a vision-language model whose images paged_hf does not serve yet: no vision family"),
])
def test_a_vision_language_model_no_family_serves_is_refused_at_wrap(llava, make, message):
    model = make()
    with pytest.raises(paged_hf.UnsupportedModelError, match=message):
        paged_hf.wrap(model, llava[1], block_size=4, num_blocks=64)


def test_its_text_is_still_served_with_its_tokenizer(llava):
    model = _other_llava()
    gen = paged_hf.wrap(model, llava[1].tokenizer, block_size=4, num_blocks=64).generator
    assert gen.generate("USER: hot ASSISTANT:", PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_idefics3_takes_expanded_token_ids_and_refuses_to_expand_one_token():
    model, processor = tiny_idefics3()
    gen = paged_hf.wrap(model, processor, block_size=4, num_blocks=64).generator
    text, seeds = PROMPTS[2]
    images = [random_image(seed) for seed in seeds]
    expanded = processor(text=text, images=images)["input_ids"][0]
    by_ids = gen.generate({"prompt_token_ids": list(expanded), "multi_modal_data": {"image": images}}, PARAMS,
                          use_tqdm=False)
    by_text = gen.generate(_prompt(text, seeds), PARAMS, use_tqdm=False)
    assert by_ids[0].outputs[0].token_ids == by_text[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="cannot expand an image token"):
        gen.add_request({"prompt_token_ids": processor.tokenizer(text)["input_ids"],
                         "multi_modal_data": {"image": images}}, PARAMS)


def test_a_prefix_hit_that_ends_inside_an_image_takes_the_rest_of_its_rows(vlm):
    # Gemma 3 never ends a chunk inside an image: a chunk of 6 ends with its image, one full block of 4 inside it
    budget, num_hit = (6, 4) if type(vlm[0]).__name__ == "Gemma3ForConditionalGeneration" else (8, 8)
    gen = _engine(vlm, num_blocks=64, max_num_batched_tokens=budget, encoder_cache_bytes=0)  # the tower runs again
    text, seeds = PROMPTS[0]
    first = gen.add_request(_prompt(text, seeds, vlm[1]), PARAMS)
    gen.step()  # `budget` tokens computed (full blocks ending inside the image), then aborted: its blocks stay cached
    gen.abort(first)
    gen.step()
    calls = EncoderCalls(vlm[0])
    try:
        outputs = gen.generate([_prompt(text, seeds, vlm[1])], PARAMS, use_tqdm=False)
    finally:
        calls.handle.remove()
    placeholders = [p for p, t in enumerate(outputs[0].prompt_token_ids) if t == IMAGE_TOKEN_ID]
    assert placeholders[0] < num_hit <= placeholders[-1]  # the hit ends inside the image
    assert gen.stats()["prefix_cache_hits"] == num_hit and calls.count == 1
    _check_equal_hf(*vlm, outputs, [(text, seeds)])


def _peft_generate(peft_model, processor, text: str, images) -> list[int]:
    inputs = processor(text=text, images=images, return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.float64)
    out = peft_model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_a_language_model_adapter_serves_image_prompts(llava, tmp_path):
    from conftest import make_adapter

    model, processor = llava
    peft_model = make_adapter(model, tmp_path / "a", seed=1, r=4, lora_alpha=8,
                              target_modules=r".*language_model.*\.(q_proj|v_proj)")
    gen = _engine(llava, num_blocks=64)
    gen.load_adapter("a", str(tmp_path / "a"))
    text, seeds = PROMPTS[2]
    images = [random_image(seed) for seed in seeds]
    outputs = gen.generate([_prompt(text, seeds), _prompt(text, seeds)], PARAMS, adapters=["a", None], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == _peft_generate(peft_model, processor, text, images)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the adapter matters
    _check_equal_hf(model, processor, outputs[1:], [PROMPTS[2]])


def test_an_adapter_of_the_vision_tower_is_refused_with_images(llava, tmp_path):
    from conftest import make_adapter

    model, _ = llava
    make_adapter(model, tmp_path / "v", seed=1, r=4, target_modules=["q_proj", "v_proj"])  # CLIP's too
    gen = _engine(llava, num_blocks=64)
    gen.load_adapter("v", str(tmp_path / "v"))
    with pytest.raises(ValueError, match="LoRA weights in the vision encoder \\(model.vision_tower"):
        gen.add_request(_prompt(*PROMPTS[0]), PARAMS, adapter="v")
    assert gen.generate([_prompt(*PROMPTS[3])], PARAMS, adapters="v", use_tqdm=False)[0].outputs[0].token_ids


def test_an_adapter_read_after_submission_is_checked_when_it_binds(llava, tmp_path):
    from conftest import make_adapter

    model, _ = llava
    make_adapter(model, tmp_path / "v", seed=1, r=4, target_modules=["q_proj", "v_proj"])
    gen = _engine(llava, num_blocks=64, lora_root=str(tmp_path))  # "v" is read on first use
    gen.add_request(_prompt(*PROMPTS[0]), PARAMS, adapter="v")
    finals = []
    while gen.has_unfinished_requests():  # the request waits for the read, then fails alone
        finals += [output for output in gen.step() if output.finished]
    [output] = finals
    assert "vision encoder" in output.error
    assert gen.stats()["num_free_blocks"] == 64


def _hf_beams(model, processor, text: str, images, width: int, max_new: int) -> list[tuple[list[int], float]]:
    """HF's beam search on one image prompt -> [(generated tokens, sequences_score)], best first."""
    inputs = processor(text=prompt_text(processor, text), images=images, return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.float64)
    out = model.generate(**inputs, num_beams=width, num_return_sequences=width, max_new_tokens=max_new,
                         do_sample=False, return_dict_in_generate=True, output_scores=True)
    prompt_length = inputs["input_ids"].shape[1]
    return [(row[prompt_length:].tolist(), score) for row, score in zip(out.sequences, out.sequences_scores.tolist())]


def test_beam_search_over_an_image_prompt_gives_hf_beams(vlm):
    model, processor = vlm
    gen = _engine(vlm, num_blocks=64, max_num_batched_tokens=16)  # the prompt is chunked through its image
    prompts = [("USER: <image> what is this ASSISTANT:", [1]), ("USER: <image> and <image> which is more", [3, 4])]
    params = paged_hf.BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    outputs = gen.beam_search([_prompt(text, seeds, processor) for text, seeds in prompts], params)
    for (text, seeds), output in zip(prompts, outputs):
        expected = _hf_beams(model, processor, text, [random_image(seed) for seed in seeds], 3, 5)
        assert [s.output_token_ids for s in output.sequences] == [tokens for tokens, _ in expected], text
        assert [s.score for s in output.sequences] == [pytest.approx(score, rel=1e-9) for _, score in expected]
    assert gen.stats()["num_free_blocks"] == 64


def test_preempted_beams_recompute_their_images(llava):
    """A pool that holds about one beam search, no prefix cache: beams give their blocks back and recompute their
    prompt, image included, later; the hypotheses do not change."""
    model, processor = llava
    prompts = [("USER: <image> what is this ASSISTANT:", [1]), ("USER: the image <image> is it hot", [2])]
    params = paged_hf.BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    blocks = max(_blocks_needed(processor, text, seeds) for text, seeds in prompts)
    gen = _engine(llava, num_blocks=3 * blocks, enable_prefix_caching=False, encoder_cache_bytes=0)  # tower again
    calls = EncoderCalls(model)
    try:
        beam_ids = [gen.add_beam_request(_prompt(text, seeds), params) for text, seeds in prompts]
        for text, seeds in prompts:  # sampled requests beside them press on the pool
            gen.add_request(_prompt(text, seeds), PARAMS)
        finished = {}
        while gen.has_unfinished_requests():
            finished.update((o.request_id, o) for o in gen.step() if o.finished)
    finally:
        calls.handle.remove()
    outputs = [finished[request_id] for request_id in beam_ids]
    assert gen.stats()["num_preemptions"] > 0 and calls.count > 4
    for (text, seeds), output in zip(prompts, outputs):
        expected = _hf_beams(model, processor, text, [random_image(seed) for seed in seeds], 3, 6)
        assert [c.token_ids for c in output.outputs] == [tokens for tokens, _ in expected], text
    assert gen.stats()["num_free_blocks"] == 3 * blocks


def test_the_drop_in_generate_serves_pixel_values_on_the_engine(vlm):
    """`wrap(model, processor).generate(**processor(...))`, as HF is called: the engine serves the image prompt
    (no fall-back to HF's generate), greedy and beam search give HF's sequences."""
    model, processor = vlm
    paged = paged_hf.wrap(model, processor, block_size=4, num_blocks=64)
    for index, (text, seeds) in enumerate(PROMPTS[:3]):
        images = [random_image(seed) for seed in seeds]
        inputs = processor(text=prompt_text(processor, text), images=images, return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.float64)
        for options in ({"do_sample": False}, {"do_sample": False, "num_beams": 2})[: 1 + (index == 2)]:
            queries = paged.generator.stats()["prefix_cache_queries"]
            expected = model.generate(**inputs, max_new_tokens=MAX_NEW, **options)
            assert torch.equal(paged.generate(**inputs, max_new_tokens=MAX_NEW, **options), expected), (text, options)
            assert paged.generator.stats()["prefix_cache_queries"] > queries  # the engine ran it


def test_an_image_request_aborted_inside_its_image_frees_everything(llava):
    """Aborted after a chunk that ends inside its image: its blocks go back, the features kept for the rest of its
    image are dropped, and a request after it still gives HF's tokens."""
    gen = _engine(llava, num_blocks=64, max_num_batched_tokens=8, enable_prefix_caching=False)
    aborted = gen.add_request(_prompt(*PROMPTS[0]), PARAMS)
    request = gen.groups[aborted].children[0]
    gen.step()  # the first 8 tokens: the image's placeholders start at 2, its 16 rows run past this chunk
    assert 0 < request.num_computed_tokens < request.mm_items[0].end and request.mm_features
    gen.abort(aborted)
    outputs = gen.generate([_prompt(*PROMPTS[1])], PARAMS, use_tqdm=False)
    assert not request.mm_features
    _check_equal_hf(*llava, outputs, PROMPTS[1:2])
    final = [o for o in gen.step() if o.request_id == aborted]  # an abort's final output, for step()'s caller
    assert final and final[0].outputs[0].finish_reason == "abort"
    assert gen.stats()["num_free_blocks"] == 64 and not gen.has_unfinished_requests()
