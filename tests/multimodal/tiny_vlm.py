"""Tiny random vision-language models (float64) with their processors built offline: LLaVA (CLIP vision tower,
Llama language model), Idefics3 (SigLIP tiles, pixel shuffle, Llama), Gemma 3 (SigLIP, pooled, Gemma 3 text with a
sliding and a full layer) and Qwen2-VL / Qwen2.5-VL (patches at the image's resolution, 3-D rotary positions); random
images, and HF's own `generate` on the processor's outputs: what the multimodal tests compare paged_hf against.

A prompt text writes `<image>` where an image goes (`prompt_text` turns it into the processor's own placeholder)."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny_server import WORDS

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 4
NUM_IMAGE_TOKENS = 16  # LLaVA: (32 / 8) ** 2 patches; the CLS row is dropped ("default" feature strategy)
#: Idefics3's tags (the image token first, so that its id is IMAGE_TOKEN_ID in both tokenizers)
IDEFICS3_TOKENS = [IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                   *[f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]]


#: Gemma 3's soft image token first (id IMAGE_TOKEN_ID, what its rows fill); its text placeholder, the processor's
#: `boi_token`, is spelt "<image>" here so that the tests' prompts serve every family
GEMMA3_TOKENS = ["<image_soft_token>", IMAGE_TOKEN, "<end_of_image>"]


def tiny_tokenizer(specials=(IMAGE_TOKEN,), **named) -> PreTrainedTokenizerFast:
    """`named`: the tokenizer's extra special tokens by name (Gemma 3's `image_token`, `boi_token`, ...)."""
    names = ["<pad>", "<s>", "</s>", "<unk>", *specials, "USER:", "ASSISTANT:", *WORDS]
    backend = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names[:128])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", **({"extra_special_tokens": named} if named else {}))


def _text_config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    initializer_range=0.1)


def tiny_llava(seed: int = 0, model_class=transformers.LlavaForConditionalGeneration):
    """-> (model, processor): float64, eval, no EOS (generation runs to max_new_tokens)."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    config = transformers.LlavaConfig(vision_config=vision, text_config=_text_config(), image_token_id=IMAGE_TOKEN_ID,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tiny_tokenizer(), patch_size=8,
                                            vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                                            num_additional_image_tokens=1)
    return model, processor


def _clip_vision():
    return transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, image_size=32, patch_size=8)


def _llava_processor(processor_class=transformers.LlavaProcessor, image_processor=None):
    image_processor = image_processor or transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                                           crop_size={"height": 32, "width": 32})
    return processor_class(image_processor=image_processor, tokenizer=tiny_tokenizer(), patch_size=8,
                           vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                           num_additional_image_tokens=1)


def tiny_vipllava(seed: int = 0):
    """-> (model, processor): LLaVA's processor; the projector reads two vision layers' features concatenated."""
    config = transformers.VipLlavaConfig(vision_config=_clip_vision(), text_config=_text_config(),
                                         image_token_id=IMAGE_TOKEN_ID, vision_feature_layers=[-2, -1])
    torch.manual_seed(seed)
    model = transformers.VipLlavaForConditionalGeneration(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    return model, _llava_processor()


def tiny_llava_next(seed: int = 0):
    """-> (model, processor): "anyres" tiles of 32 pixels on a 64-pixel grid, unpadded rows with a newline each."""
    pinpoints = [[32, 64], [64, 32], [64, 64]]
    config = transformers.LlavaNextConfig(vision_config=_clip_vision(), text_config=_text_config(),
                                          image_token_id=IMAGE_TOKEN_ID, vision_feature_layer=-2,
                                          vision_feature_select_strategy="default", image_grid_pinpoints=pinpoints)
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    image_processor = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 32},
                                                              crop_size={"height": 32, "width": 32},
                                                              image_grid_pinpoints=pinpoints)
    return model, _llava_processor(transformers.LlavaNextProcessor, image_processor)


def tiny_idefics3(seed: int = 0):
    """-> (model, processor): float64, eval, no EOS; images cut into 32-pixel tiles of 4 rows each (+ a global one)."""
    vision = transformers.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=32, patch_size=8)
    config = transformers.Idefics3Config(vision_config=vision, text_config=_text_config(), image_token_id=IMAGE_TOKEN_ID,
                                         scale_factor=2)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    image_processor = transformers.Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": 64},
                                                             max_image_size={"longest_edge": 32})
    processor = transformers.Idefics3Processor(image_processor=image_processor,
                                               tokenizer=tiny_tokenizer(IDEFICS3_TOKENS), image_seq_len=4)
    return model, processor


def tiny_gemma3(seed: int = 0):
    """-> (model, processor): float64, eval, no EOS. An image is 4 tokens (16 patches pooled 2 x 2) framed by
    `<image>` (its begin-of-image) and `<end_of_image>`; layer 0 attends a window of 3 keys (shorter than an image,
    so the window and the image's bidirectional span both shape its mask), layer 1 everything."""
    text = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=3,
                                         layer_types=["sliding_attention", "full_attention"],
                                         max_position_embeddings=512, initializer_range=0.1)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=IMAGE_TOKEN_ID, boi_token_index=5, eoi_token_index=6)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float64).eval()
    with torch.no_grad():  # HF initialises the projection to zeros: images would not matter
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    model.generation_config.eos_token_id = None
    tokenizer = tiny_tokenizer(GEMMA3_TOKENS, image_token=GEMMA3_TOKENS[0], boi_token=IMAGE_TOKEN,
                               eoi_token=GEMMA3_TOKENS[2])
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return model, transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                               image_seq_length=4)


#: Qwen-VL's tokens (the image token first: IMAGE_TOKEN_ID); a prompt frames its image as the chat template does
QWEN_TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _image_only(processor_class):
    """The processor without its video processor, which needs torchvision (its wheel does not import with the CPU
    torch): the same image path and token expansion."""

    class ImageOnly(processor_class):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, chat_template=chat_template)

    return ImageOnly


def tiny_qwen_vl(version: str = "2", seed: int = 0):
    """-> (model, processor) of Qwen2-VL ("2") or Qwen2.5-VL ("2.5"): float64, eval, no EOS; an image is resized to
    4 to 8 merged 28-pixel squares (2 x 4 or 2 x 3 rows of the grid, one token each)."""
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    patches = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_heads=4, depth=2)
    if version == "2":
        vision = dict(embed_dim=32, hidden_size=64, mlp_ratio=2, **patches)
        classes = (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration,
                   transformers.Qwen2VLProcessor)
    else:  # its vision tower attends within windows of 2 x 2 merged squares but in its last (full) block
        vision = dict(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56,
                      fullatt_block_indexes=[1], **patches)
        classes = (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                   transformers.Qwen2_5_VLProcessor)
    config = classes[0](vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID, vision_start_token_id=5,
                        vision_end_token_id=6, video_token_id=7)
    torch.manual_seed(seed)
    model = classes[1](config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    image_processor = transformers.Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=8 * 28 * 28,
                                                            patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = _image_only(classes[2])(image_processor=image_processor, tokenizer=tiny_tokenizer(QWEN_TOKENS))
    return model, processor


def prompt_text(processor, text: str) -> str:
    """`<image>` -> the processor's placeholder text (Qwen-VL's framed `<|image_pad|>`)."""
    return text.replace(IMAGE_TOKEN, QWEN_IMAGE) if processor.image_token == QWEN_TOKENS[0] else text


def random_image(seed: int) -> Image.Image:
    """Odd seeds are wide (Idefics3 cuts them into 1 x 2 tiles), even ones nearly square (2 x 2)."""
    size = (20, 60) if seed % 2 else (40, 50)
    pixels = np.random.RandomState(seed).rand(*size, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def hf_generate(model, processor, text: str, images, max_new_tokens: int) -> tuple[list[int], list[dict[int, float]]]:
    """HF's greedy tokens for one prompt, and each step's top-5 logprobs (log_softmax of its scores, float64)."""
    inputs = processor(text=prompt_text(processor, text), images=images or None, return_tensors="pt")
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.float64)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    top = []
    for scores in out.scores:
        logprobs = torch.log_softmax(scores[0].to(torch.float64), -1)
        values, ids = logprobs.topk(5)
        top.append(dict(zip(ids.tolist(), values.tolist())))
    return tokens, top


class EncoderCalls:
    """Counts the vision tower's calls (a forward hook): paged_hf calls it once per image."""

    def __init__(self, model):
        self.count = 0
        tower = next(getattr(model.model, name) for name in ("vision_tower", "vision_model", "visual")
                     if hasattr(model.model, name))
        self.handle = tower.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.count += 1
