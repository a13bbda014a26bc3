"""LLaVA (`LlavaForConditionalGeneration`) and its variant VipLLaVA (`VipLlavaForConditionalGeneration`, features of
several vision layers concatenated): a vision tower (CLIP, SigLIP, ...) and a projector over one image's patches,
merged over the `<image>` tokens that the processor repeats once per feature row.

Recognised by their classes (the model and its inner model exactly, so a subclass whose forward merges otherwise is
not taken for it); `encode` is the model's own `get_image_features` with the config's feature layers and strategy,
on one image at a time (the batch of a prompt's images gives the same rows: each image is encoded alone).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import LlavaForConditionalGeneration, VipLlavaForConditionalGeneration
from transformers.models.llava.modeling_llava import LlavaModel
from transformers.models.vipllava.modeling_vipllava import VipLlavaModel

from paged_hf.multimodal.family import VisionFamily


class LlavaFamily(VisionFamily):
    name = "llava"
    encoder_modules = ("model.vision_tower", "model.multi_modal_projector")
    classes = ((LlavaForConditionalGeneration, LlavaModel),)
    per_image_inputs: tuple[str, ...] = ("pixel_values",)  # the processor's outputs, one row per image

    def split(self, processed: Mapping, counts: list[int]) -> list[dict[str, torch.Tensor]]:
        other = sorted(set(processed) - {*self.per_image_inputs, "input_ids", "attention_mask"})
        if other:
            raise ValueError(f"the {self.name} processor gave {other}: only {list(self.per_image_inputs)} are served")
        return [self.image_inputs(processed, i) for i in range(len(counts))]

    def image_inputs(self, processed: Mapping, index: int) -> dict[str, torch.Tensor]:
        """Image `index`'s rows of the processor's per-image outputs."""
        return {name: processed[name][index : index + 1] for name in self.per_image_inputs}

    @torch.inference_mode()
    def encode(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = next(self.model.model.vision_tower.parameters())
        inputs = {name: value.to(weight.device) for name, value in data.items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(weight.dtype)
        features = self.model.get_image_features(**inputs, return_dict=True).pooler_output
        if isinstance(features, (list, tuple)):  # one [rows, hidden_size] per image
            features = torch.cat(list(features), dim=0)
        return features.reshape(-1, features.shape[-1])  # [num_embeds, hidden_size]


class VipLlavaFamily(LlavaFamily):
    name = "vipllava"
    classes = ((VipLlavaForConditionalGeneration, VipLlavaModel),)
