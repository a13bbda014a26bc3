"""Idefics3 (`Idefics3ForConditionalGeneration`, SmolVLM's architecture): an image is cut into tiles plus a global
view; each tile's SigLIP patches are pixel-shuffled and projected into `image_seq_len` rows, and the prompt frames
each tile's run of `<image>` tokens with `<fake_token_around_image>` and a `<row_r_col_c>` or `<global-img>` tag.

An image's span runs from its first `<image>` token to its last (the tags inside it are the prompt's own tokens);
its tiles are the runs of `<image>` tokens up to the one after `<global-img>`, which ends it. `encode` is the
model's own `get_image_features` on the image's tiles alone (HF encodes all tiles of a prompt at once; each tile
is encoded alone either way).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import Idefics3ForConditionalGeneration
from transformers.models.idefics3.modeling_idefics3 import Idefics3Model

from paged_hf.multimodal.family import VisionFamily


class Idefics3Family(VisionFamily):
    name = "idefics3"
    encoder_modules = ("model.vision_model", "model.connector")
    classes = ((Idefics3ForConditionalGeneration, Idefics3Model),)

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        config = model.config
        patches = config.vision_config.image_size // config.vision_config.patch_size
        self.tile_tokens = int(patches**2 / config.scale_factor**2)  # rows per tile, the processor's image_seq_len


    def check_processor(self, processor) -> None:
        super().check_processor(processor)
        if processor.image_seq_len != self.tile_tokens:
            raise ValueError(f"the processor's image_seq_len {processor.image_seq_len} is not the model's "
                             f"{self.tile_tokens} rows per tile")

    def replacement_ids(self, processor, processed: Mapping, index: int) -> list[int]:
        raise ValueError("the Idefics3 processor's expansion needs the tiling of its own call")

    def num_images(self, processor, processed: Mapping, token_ids: list[int]) -> int:
        """One `<global-img>` tag per image (its tiles share one row of `pixel_values`)."""
        return token_ids.count(processor.global_image_token_id)

    def placeholder_counts(self, processor, processed: Mapping, token_ids: list[int], num_images: int) -> list[int]:
        """Each image's `<image>` tokens: its tiles' runs, up to and including the run after `<global-img>`."""
        counts, current = [], 0
        for start, length in _runs(token_ids, self.image_token_id):
            current += length
            if start > 0 and token_ids[start - 1] == processor.global_image_token_id:
                counts.append(current)
                current = 0
        if current or len(counts) != num_images:
            raise ValueError(f"the prompt's image tokens form {len(counts)} framed images for {num_images} images")
        return counts

    def split(self, processed: Mapping, counts: list[int]) -> list[dict[str, torch.Tensor]]:
        other = sorted(set(processed) - {"pixel_values", "pixel_attention_mask", "input_ids", "attention_mask"})
        if other:
            raise ValueError(f"the Idefics3 processor gave {other}: not served")
        pixel_values = processed["pixel_values"]  # [1, num_tiles, channels, height, width]
        mask = processed.get("pixel_attention_mask")  # [1, num_tiles, height, width]
        data, first = [], 0
        for count in counts:
            tiles = slice(first, first + count // self.tile_tokens)
            data.append({"pixel_values": pixel_values[:, tiles]} |
                        ({} if mask is None else {"pixel_attention_mask": mask[:, tiles]}))
            first = tiles.stop
        if first != pixel_values.shape[1]:
            raise ValueError(f"the processor gave {pixel_values.shape[1]} tiles where the prompt frames {first}")
        return data

    @torch.inference_mode()
    def encode(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = next(self.model.model.vision_model.parameters())
        pixel_values = data["pixel_values"].to(device=weight.device, dtype=weight.dtype)
        mask = data.get("pixel_attention_mask")
        mask = None if mask is None else mask.to(weight.device)
        outputs = self.model.get_image_features(pixel_values=pixel_values, pixel_attention_mask=mask, return_dict=True)
        return torch.cat(list(outputs.pooler_output), dim=0)  # [num_tiles * tile_tokens, hidden_size]


def _runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token_id`."""
    runs, start = [], None
    for position, token in enumerate([*token_ids, None]):
        if token == token_id and start is None:
            start = position
        elif token != token_id and start is not None:
            runs.append((start, position - start))
            start = None
    return runs
