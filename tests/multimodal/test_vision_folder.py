"""A vision-language model's folder by path: `paged_hf.LLM(path)` loads it with its processor and serves vLLM's
prompt dicts with images (HF's `generate` tokens, float64), `LLM.chat` takes image_url parts, `paged-hf serve path`
answers an openai SDK chat with a data: URL image, and a folder without a processor serves its text."""

from __future__ import annotations

import base64
import io

import pytest
from serve_process import ServerProcess
from tiny_vlm import hf_generate, random_image, tiny_llava

import paged_hf
from paged_hf import SamplingParams

MAX_NEW = 5
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<image> {% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny float64 LLaVA and its processor (with a chat template), saved; -> (path, model, processor)."""
    path = tmp_path_factory.mktemp("tiny-llava")
    model, processor = tiny_llava()
    processor.chat_template = TEMPLATE
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path), model, processor


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_llm_on_a_vision_folder_gives_hf_generate(folder):
    path, model, processor = folder
    llm = paged_hf.LLM(path, dtype="float64", device="cpu", block_size=4, num_blocks=64)
    assert llm.processor is not None and llm.get_tokenizer() is llm.processor.tokenizer
    prompts = [("USER: <image> what is this ASSISTANT:", [random_image(1)]),
               ("USER: the image <image> and <image> ASSISTANT:", [random_image(2), random_image(3)])]
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts]
                        + ["USER: tell me of the water ASSISTANT:"], PARAMS, use_tqdm=False)
    for out, (text, images) in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_generate(model, processor, text, images, MAX_NEW)[0]
    assert outs[2].outputs[0].token_ids == hf_generate(model, processor, "USER: tell me of the water ASSISTANT:", [],
                                                       MAX_NEW)[0]
    image = random_image(1)
    chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                  {"type": "image_url", "image_url": {"url": data_url(image)}}]}],
                    PARAMS, use_tqdm=False)
    expected = hf_generate(model, processor, "USER: what is this <image> ASSISTANT:", [image], MAX_NEW)[0]
    assert chat[0].outputs[0].token_ids == expected


def test_a_vision_folder_without_its_processor_serves_text(folder, tmp_path):
    path, model, processor = folder
    model.save_pretrained(tmp_path)
    processor.tokenizer.save_pretrained(tmp_path)  # no processor_config.json
    llm = paged_hf.LLM(str(tmp_path), dtype="float64", device="cpu", block_size=4, num_blocks=64)
    assert llm.processor is None
    text = "USER: tell me of the water ASSISTANT:"
    out = llm.generate(text, PARAMS, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_generate(model, processor, text, [], MAX_NEW)[0]
    with pytest.raises(ValueError, match="needs the model's processor"):
        llm.generate({"prompt": "USER: <image> ASSISTANT:", "multi_modal_data": {"image": random_image(1)}},
                     PARAMS, use_tqdm=False)


def test_paged_hf_serve_on_a_vision_folder_answers_an_image(folder):
    openai = pytest.importorskip("openai")
    path, model, processor = folder
    image = random_image(2)
    expected = hf_generate(model, processor, "USER: what is this <image> ASSISTANT:", [image], MAX_NEW)[0]
    with ServerProcess(path, "--dtype", "float64", "--block-size", "4") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        answer = client.chat.completions.create(
            model="tiny", max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}, messages=[
                {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}}]}])
    assert answer.choices[0].message.content == processor.tokenizer.decode(expected, skip_special_tokens=True)


def test_a_vision_model_no_family_serves_is_wrapped_with_its_tokenizer():
    """What `LLM` and `paged-hf serve` do with a loaded folder whose images no family serves (a subclass here)."""
    from transformers import LlavaForConditionalGeneration

    from paged_hf.multimodal.registry import served_processor

    class Patched(LlavaForConditionalGeneration):
        pass

    model, processor = tiny_llava(model_class=Patched)
    tokenizer, why = served_processor(model, processor)
    assert tokenizer is processor.tokenizer and "Patched" in why
    assert served_processor(tiny_llava()[0], processor) == (processor, None)
