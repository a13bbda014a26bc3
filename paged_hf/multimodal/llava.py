"""LLaVA (`LlavaForConditionalGeneration`): a vision tower (CLIP, SigLIP, ...) and a projector over one image's
patches, merged over the `<image>` tokens that the processor repeats once per feature row.

Recognised by its classes (the model and its `LlavaModel` exactly, so a subclass whose forward merges otherwise is
not taken for it); `encode` is the model's own `get_image_features` with the config's feature layer and strategy,
on one image at a time (the batch of a prompt's images gives the same rows: each image is encoded alone).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import LlavaForConditionalGeneration
from transformers.models.llava.modeling_llava import LlavaModel

from paged_hf.multimodal.family import VisionFamily


class LlavaFamily(VisionFamily):
    name = "llava"
    encoder_modules = ("model.vision_tower", "model.multi_modal_projector")

    @staticmethod
    def matches(model: torch.nn.Module) -> bool:
        return type(model) is LlavaForConditionalGeneration and type(model.model) is LlavaModel

    def split(self, processed: Mapping, counts: list[int]) -> list[dict[str, torch.Tensor]]:
        other = sorted(set(processed) - {"pixel_values", "input_ids", "attention_mask"})
        if other:
            raise ValueError(f"the LLaVA processor gave {other}: only pixel_values are served (one image per row)")
        pixel_values = processed["pixel_values"]  # [num_images, channels, height, width]
        return [{"pixel_values": pixel_values[i : i + 1]} for i in range(pixel_values.shape[0])]

    @torch.inference_mode()
    def encode(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = next(self.model.model.vision_tower.parameters())
        pixel_values = data["pixel_values"].to(device=weight.device, dtype=weight.dtype)
        outputs = self.model.get_image_features(pixel_values=pixel_values, return_dict=True)
        return torch.cat(list(outputs.pooler_output), dim=0)  # [num_patches, hidden_size]
