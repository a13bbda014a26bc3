"""A tiny random LLaVA (CLIP vision tower, Llama language model, float64) with its processor built offline, random
images, and HF's own `generate` on the processor's outputs: what the multimodal tests compare paged_hf against."""

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
NUM_IMAGE_TOKENS = 16  # (32 / 8) ** 2 patches; the CLS row is dropped ("default" feature strategy)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    names = ["<pad>", "<s>", "</s>", "<unk>", IMAGE_TOKEN, "USER:", "ASSISTANT:", *WORDS]
    backend = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names[:128])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def tiny_llava(seed: int = 0, model_class=transformers.LlavaForConditionalGeneration):
    """-> (model, processor): float64, eval, no EOS (generation runs to max_new_tokens)."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    text = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    initializer_range=0.1)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tiny_tokenizer(), patch_size=8,
                                            vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                                            num_additional_image_tokens=1)
    return model, processor


def random_image(seed: int, size=(40, 50)) -> Image.Image:
    pixels = np.random.RandomState(seed).rand(*size, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def hf_generate(model, processor, text: str, images, max_new_tokens: int) -> tuple[list[int], list[dict[int, float]]]:
    """HF's greedy tokens for one prompt, and each step's top-5 logprobs (log_softmax of its scores, float64)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
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
    """Counts the images the vision tower encodes (a forward hook; one call per image in paged_hf)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.model.vision_tower.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.count += args[0].shape[0] if args else 1
