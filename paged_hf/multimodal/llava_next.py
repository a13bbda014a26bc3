"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`, "anyres"): an image is resized to the best of the config's grid
pinpoints and cut into tiles of the vision tower's size plus a downscaled whole view; the tiles' projected patches
are unpadded to the image's aspect ratio with an `image_newline` row after each row of patches. The processor
writes as many `<image>` tokens as those rows.

The per-image inputs are its tiles (the processor pads every image of a prompt to the most tiles; an image's rows
are cut back to its own, so its content hash does not depend on the other images of the prompt) and its
`image_sizes`, which the model's own `get_image_features` reads to unpad.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import LlavaNextForConditionalGeneration
from transformers.models.llava_next.modeling_llava_next import LlavaNextModel, image_size_to_num_patches

from paged_hf.multimodal.llava import LlavaFamily


class LlavaNextFamily(LlavaFamily):
    name = "llava_next"
    encoder_modules = ("model.vision_tower", "model.multi_modal_projector", "model.image_newline")
    classes = ((LlavaNextForConditionalGeneration, LlavaNextModel),)
    per_image_inputs = ("pixel_values", "image_sizes")

    def image_inputs(self, processed: Mapping, index: int) -> dict[str, torch.Tensor]:
        image_size = processed["image_sizes"][index]
        config = self.model.config
        tiles = image_size_to_num_patches(image_size=image_size, grid_pinpoints=config.image_grid_pinpoints,
                                          patch_size=config.vision_config.image_size)
        return {"pixel_values": processed["pixel_values"][index : index + 1, :tiles],
                "image_sizes": processed["image_sizes"][index : index + 1]}
