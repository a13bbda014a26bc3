"""Qwen2-VL and Qwen2.5-VL on the paged engine beyond test_images.py's shared checks: their 3-D rotary positions.

A prompt's positions are the model's own `get_rope_index` (computed once at submission); a generated token sits at
its index plus the prompt's delta on all three rows, so a long generation after images with a large delta gives HF's
tokens only if every decode step is placed right. Token-id prompts are expanded and placed as text prompts are; a LoRA
adapter of the language model serves image prompts, one of the vision tower is refused with them; a chat `image_url`
through the server gives HF's tokens.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_vlm import QWEN_IMAGE, hf_generate, prompt_text, random_image, tiny_qwen_vl

import paged_hf
from paged_hf import SamplingParams
from paged_hf.core.multimodal import MultiModalPositions
from paged_hf.multimodal.positions import request_rows
from paged_hf.multimodal.registry import vision_family

LONG = 24
#: two images (8 and 6 tokens on grids 2 x 4 and 2 x 3: delta -7), a text-only prompt beside them
TWO_IMAGES = "USER: <image> and <image> which is more ASSISTANT:"
TEXT = "USER: tell me of the water ASSISTANT:"


@pytest.fixture(scope="module", params=["2", "2.5"])
def qwen(request):
    return tiny_qwen_vl(request.param)


def _engine(qwen, **config):
    model, processor = qwen
    return paged_hf.wrap(model, processor, block_size=4, num_blocks=64, **config).generator


def _hf_positions(model, processor, text: str, images):
    """HF's own positions of the processor's output: rows [3, num_tokens] and the delta."""
    inputs = processor(text=prompt_text(processor, text), images=images, return_tensors="pt")
    rows, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    return inputs["input_ids"][0].tolist(), rows[:, 0], int(delta)


def test_a_long_generation_after_images_decodes_at_hfs_positions(qwen):
    model, processor = qwen
    images = [random_image(3), random_image(4)]
    _, _, delta = _hf_positions(model, processor, TWO_IMAGES, images)
    assert delta < -4  # the images take fewer positions than tokens: decode positions differ from token indices
    gen = _engine(qwen, max_num_batched_tokens=8)  # chunks cut through both images
    params = SamplingParams(max_new_tokens=LONG, temperature=0, logprobs=5, ignore_eos=True)
    prompts = [{"prompt": prompt_text(processor, TWO_IMAGES), "multi_modal_data": {"image": images}}, {"prompt": TEXT}]
    outputs = gen.generate(prompts, params, use_tqdm=False)
    for (text, image_list), output in zip([(TWO_IMAGES, images), (TEXT, [])], outputs):
        tokens, top = hf_generate(model, processor, text, image_list, LONG)
        assert output.outputs[0].token_ids == tokens, text
        for theirs, ours in zip(top, output.outputs[0].logprobs):
            assert all(abs(ours[token] - value) < 1e-6 for token, value in theirs.items()), text


def test_positions_are_the_models_get_rope_index_for_text_and_token_ids(qwen):
    model, processor = qwen
    gen = _engine(qwen)
    images = [random_image(3), random_image(4)]
    ids, rows, delta = _hf_positions(model, processor, TWO_IMAGES, images)
    by_text = gen.process_prompt({"prompt": prompt_text(processor, TWO_IMAGES), "multi_modal_data": {"image": images}})
    one_pad = processor.tokenizer(TWO_IMAGES.replace("<image>", QWEN_IMAGE))["input_ids"]  # one <|image_pad|> each
    by_ids = gen.process_prompt({"prompt_token_ids": one_pad, "multi_modal_data": {"image": images}})
    for processed in (by_text, by_ids):
        assert processed.token_ids == ids
        assert torch.equal(processed.positions.rows, rows) and processed.positions.delta == delta
    assert gen.process_prompt({"prompt": TEXT}).positions is None  # text is placed at its token indices


def test_rows_of_a_range_across_the_prompts_end():
    own = MultiModalPositions(torch.tensor([[0, 1, 1, 3], [0, 1, 2, 3], [0, 2, 1, 3]]), delta=-1)
    assert request_rows(own, 2, 4).tolist() == [[1, 3, 3, 4], [2, 3, 3, 4], [1, 3, 3, 4]]
    assert request_rows(own, 5, 1).tolist() == [[4], [4], [4]]  # a decode step
    assert request_rows(own, 1, 2).tolist() == [[1, 1], [1, 2], [2, 1]]  # within the prompt


def test_video_tokens_and_images_the_model_cannot_place_are_refused_at_submission(qwen):
    gen = _engine(qwen)
    ids = qwen[1].tokenizer(f"USER: {QWEN_IMAGE} <|video_pad|> hi")["input_ids"]
    with pytest.raises(ValueError, match="videos are not served"):
        gen.add_request({"prompt_token_ids": ids, "multi_modal_data": {"image": [random_image(1)]}})
    adjacent = qwen[1].tokenizer("USER: <|vision_start|> <|image_pad|> <|image_pad|> <|vision_end|> hi")["input_ids"]
    with pytest.raises(ValueError, match="cannot place the prompt's image tokens"):  # one run of tokens, two grids
        gen.add_request({"prompt_token_ids": adjacent,
                         "multi_modal_data": {"image": [random_image(1), random_image(3)]}})
    assert not gen.has_unfinished_requests()


def test_a_subclass_is_not_taken_for_the_family(qwen):
    model, processor = qwen

    class OtherQwen(type(model)):  # its forward may place or merge otherwise
        pass

    assert vision_family(model) is not None
    other = OtherQwen(model.config).eval()
    assert vision_family(other) is None
    with pytest.raises(paged_hf.UnsupportedModelError, match="OtherQwen is a vision-language model"):
        paged_hf.wrap(other, processor, block_size=4, num_blocks=64)


def test_a_processor_of_another_merge_size_is_refused(qwen):
    model, processor = qwen
    other = type(processor)(image_processor=transformers.Qwen2VLImageProcessorPil(merge_size=1),
                            tokenizer=processor.tokenizer)
    with pytest.raises(ValueError, match="merge_size 1"):
        paged_hf.wrap(model, other, block_size=4, num_blocks=64)


def test_a_language_model_adapter_serves_images_and_a_vision_one_is_refused(tmp_path):
    from conftest import make_adapter  # noqa: PLC0415

    qwen = model, processor = tiny_qwen_vl("2")  # LoRA routing is the language model's: one version is enough
    peft_model = make_adapter(model, tmp_path / "a", seed=1, r=4, lora_alpha=8,
                              target_modules=r".*language_model.*\.(q_proj|v_proj)")
    make_adapter(model, tmp_path / "v", seed=1, r=4, target_modules=r".*visual.*\.qkv")  # the vision tower's
    gen = _engine(qwen)
    gen.load_adapter("a", str(tmp_path / "a"))
    gen.load_adapter("v", str(tmp_path / "v"))
    images = [random_image(3), random_image(4)]
    prompt = {"prompt": prompt_text(processor, TWO_IMAGES), "multi_modal_data": {"image": images}}
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    output = gen.generate([prompt], params, adapters="a", use_tqdm=False)[0]
    inputs = processor(text=prompt_text(processor, TWO_IMAGES), images=images, return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.float64)
    expected = peft_model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert output.outputs[0].token_ids == expected.tolist()
    assert output.outputs[0].token_ids != gen.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="LoRA weights in the vision encoder \\(model.visual"):
        gen.add_request(prompt, params, adapter="v")


def test_a_chat_image_url_through_the_server_gives_hfs_tokens():
    """The server's worker thread processes the chat's image (the positions with it) as `add_request` does."""
    openai = pytest.importorskip("openai")
    from test_serve_images import data_url, encoded  # noqa: PLC0415
    from tiny_server import serving  # noqa: PLC0415

    from paged_hf.serving.openai import create_app  # noqa: PLC0415

    model, processor = tiny_qwen_vl("2")
    processor.chat_template = ("{% for m in messages %}{{ m['role'] | upper }}: {% for p in m['content'] %}"
                               "{% if p['type'] == 'image' %}" + QWEN_IMAGE + " {% else %}{{ p['text'] }} {% endif %}"
                               "{% endfor %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    image = random_image(3)
    gen = paged_hf.wrap(model, processor, block_size=4, num_blocks=64).generator
    with serving(create_app(gen, processor, "tiny-qwen")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        content = [{"type": "text", "text": "what is this"},
                   {"type": "image_url", "image_url": {"url": data_url(encoded(image))}}]
        answer = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": content}],
                                                max_tokens=LONG, temperature=0, extra_body={"ignore_eos": True})
    tokens, _ = hf_generate(model, processor, "USER: what is this <image> ASSISTANT:", [image], LONG)
    assert answer.choices[0].message.content == processor.tokenizer.decode(tokens, skip_special_tokens=True)
