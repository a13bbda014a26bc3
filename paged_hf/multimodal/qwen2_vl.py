"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): images at their
own resolution, cut into patches whose flattened pixels the processor concatenates over all images
(`pixel_values` [num_patches, channels * temporal_patch_size * patch_size ** 2]) with each image's patch grid
(`image_grid_thw` [num_images, 3]); the vision tower merges each `spatial_merge_size ** 2` patches into one row that
fills one `<|image_pad|>` token.

Their language model places tokens by multimodal rotary positions, a temporal, height and width row per token: text
counts up on all three, an image's tokens sit on its grid, and the text after an image resumes past the grid's
largest side. The family computes them once per prompt at submission with the model's own `get_rope_index` (so they
are HF's) and keeps them on the request with the generated tokens' delta (`core.multimodal.MultiModalPositions`);
each step's `position_ids` [3, 1, num_tokens] are taken from them (`positions.py`). Text-only steps keep the text
model's positions (the token indices, which the model repeats on its three rows itself).

Recognised by their classes exactly (a subclass may place or merge otherwise); an image is encoded alone by the
model's own `get_image_features` on its patches and grid (HF encodes a prompt's images together, each image's
attention within itself either way). Videos are not served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from paged_hf.core.multimodal import MultiModalItem, MultiModalPositions
from paged_hf.core.scheduler_output import SchedulerOutput
from paged_hf.multimodal.family import VisionFamily
from paged_hf.multimodal.positions import step_position_rows

IMAGE_KEYS = {"pixel_values", "image_grid_thw"}
TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids"}


class Qwen2VLFamily(VisionFamily):
    name = "qwen2_vl"
    encoder_modules = ("model.visual",)  # the vision tower and its patch merger (the projector)
    classes = ((Qwen2VLForConditionalGeneration, Qwen2VLModel),)

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        vision = model.config.vision_config
        self.merge_size = vision.spatial_merge_size
        self.patch_size = vision.patch_size
        self.video_token_id = model.config.video_token_id

    def check_processor(self, processor) -> None:
        super().check_processor(processor)
        images = processor.image_processor
        if (images.merge_size, images.patch_size) != (self.merge_size, self.patch_size):
            raise ValueError(f"the processor's merge_size {images.merge_size} and patch_size {images.patch_size} are "
                             f"not the model's {self.merge_size} and {self.patch_size}")

    def num_images(self, processor, processed: Mapping, token_ids: list[int]) -> int:
        """One grid per image (`pixel_values` holds their patches, not one row per image)."""
        return processed["image_grid_thw"].shape[0]

    def split(self, processed: Mapping, counts: list[int]) -> list[dict[str, torch.Tensor]]:
        other = sorted(set(processed) - IMAGE_KEYS - TEXT_KEYS)
        if other:
            raise ValueError(f"the {type(self.model).__name__} processor gave {other}: only images are served")
        grids = processed["image_grid_thw"]  # [num_images, 3]
        pixel_values = processed["pixel_values"]  # [num_patches, patch_dim], all images' patches in prompt order
        num_patches = grids.prod(-1).tolist()
        if sum(num_patches) != pixel_values.shape[0] or len(num_patches) != len(counts):
            raise ValueError(f"the processor gave {pixel_values.shape[0]} patches for grids {grids.tolist()}")
        for count, patches in zip(counts, num_patches):
            if count != patches // self.merge_size**2:
                raise ValueError(f"an image of {patches} patches takes {count} placeholder tokens, not "
                                 f"{patches // self.merge_size ** 2}")
        firsts = [0, *torch.tensor(num_patches).cumsum(0).tolist()]
        return [{"pixel_values": pixel_values[firsts[i] : firsts[i + 1]], "image_grid_thw": grids[i : i + 1]}
                for i in range(len(counts))]

    @torch.inference_mode()
    def encode(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = next(self.model.model.visual.parameters())
        pixel_values = data["pixel_values"].to(device=weight.device, dtype=weight.dtype)
        grid = data["image_grid_thw"].to(weight.device)
        outputs = self.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grid, return_dict=True)
        return torch.cat(list(outputs.pooler_output), dim=0)  # [num_patches / merge_size ** 2, hidden_size]

    def prompt_positions(self, token_ids: list[int], items: Sequence[MultiModalItem]) -> MultiModalPositions | None:
        """The model's own `get_rope_index` on the prompt: rows [3, num_prompt_tokens] and the delta."""
        if self.video_token_id in token_ids:
            raise ValueError(f"the prompt holds video tokens (id {self.video_token_id}): videos are not served")
        if not items:
            return None
        input_ids = torch.tensor([token_ids])  # [1, num_tokens]
        token_types = (input_ids == self.image_token_id).long()  # the processor's mm_token_type_ids: 1 on images
        grids = torch.cat([item.data["image_grid_thw"] for item in items])  # [num_images, 3]
        try:
            rows, deltas = self.model.model.get_rope_index(input_ids, mm_token_type_ids=token_types,
                                                           image_grid_thw=grids)
        except (StopIteration, RuntimeError, IndexError) as error:  # e.g. two images' tokens with nothing between
            raise ValueError(f"the model cannot place the prompt's image tokens: {type(error).__name__}: "
                             f"{error}") from None
        return MultiModalPositions(rows[:, 0].clone(), int(deltas.reshape(-1)[0]))  # rows [3, num_tokens]

    def step_position_ids(self, out: SchedulerOutput, positions: torch.Tensor) -> torch.Tensor | None:
        rows = step_position_rows(out, positions, 3)  # [3, num_tokens]
        return None if rows is None else rows[:, None]  # [3, 1, num_tokens]: the three rows, one packed row


class Qwen2_5_VLFamily(Qwen2VLFamily):
    """Qwen2.5-VL: the same placement and merge (its vision tower attends within windows, its own business)."""

    name = "qwen2_5_vl"
    classes = ((Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLModel),)
