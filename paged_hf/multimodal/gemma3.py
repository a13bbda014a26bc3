"""Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP vision tower whose patches are average-pooled and projected
into `mm_tokens_per_image` rows, merged over as many `<image_soft_token>`s, which the processor frames with
`<start_of_image>` and `<end_of_image>` (the text's placeholder is `<start_of_image>`, its `boi_token`).

Gemma 3 attends bidirectionally among one image's tokens: HF's forward (given the processor's `token_type_ids`)
lets every soft token of a run see every other token of that run, in sliding and full layers alike, while text
stays causal (`create_masks_for_vision_model`: full layers causal OR same run; sliding layers that AND the window).
Its items therefore name each run of soft tokens as a bidirectional span (`bidirectional_images`): the scheduler
never ends a chunk inside one and the kernels' mask lets its queries see its later keys (kernels/torch_kernel.py).
At decode HF passes no `token_type_ids` (a decode token is text, causal either way), nor does the engine.

Recognised by its classes exactly (the model and its `Gemma3Model`); `encode` is the model's own
`get_image_features` on one image. Pan-and-scan crops (`do_pan_and_scan`) are refused: their count per image does
not survive the processor's output.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import Gemma3ForConditionalGeneration
from transformers.models.gemma3.modeling_gemma3 import Gemma3Model

from paged_hf.multimodal.family import VisionFamily


class Gemma3Family(VisionFamily):
    name = "gemma3"
    encoder_modules = ("model.vision_tower", "model.multi_modal_projector")
    classes = ((Gemma3ForConditionalGeneration, Gemma3Model),)
    bidirectional_images = True

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.image_tokens = model.config.mm_tokens_per_image  # rows per image
        self.vocab_size = model.config.text_config.vocab_size

    def check_processor(self, processor) -> None:
        """The processor's `image_token_id` is its `<start_of_image>`; the rows fill its tokenizer's image token."""
        tokenizer = getattr(processor, "tokenizer", None)
        token_id = getattr(tokenizer, "image_token_id", None)
        if token_id != self.image_token_id:
            raise ValueError(f"the processor's image token id {token_id} is not the model's config.image_token_id "
                             f"{self.image_token_id}: a processor of another model?")
        if getattr(processor, "image_seq_length", None) != self.image_tokens:
            raise ValueError(f"the processor's image_seq_length {getattr(processor, 'image_seq_length', None)} is "
                             f"not the model's mm_tokens_per_image {self.image_tokens}")

    def replacement_ids(self, processor, processed: Mapping, index: int) -> list[int]:
        raise ValueError("give Gemma 3's expanded ids (<start_of_image>, its image tokens, <end_of_image>)")

    def placeholder_counts(self, processor, processed: Mapping, token_ids: list[int], num_images: int) -> list[int]:
        found = token_ids.count(self.image_token_id)
        if found != self.image_tokens * num_images:
            raise ValueError(f"the prompt holds {found} image tokens for {num_images} images of {self.image_tokens} "
                             "each (pan-and-scan crops, do_pan_and_scan, are not served)")
        return [self.image_tokens] * num_images

    def split(self, processed: Mapping, counts: list[int]) -> list[dict[str, torch.Tensor]]:
        other = sorted(set(processed) - {"pixel_values", "input_ids", "attention_mask", "token_type_ids"})
        if other:
            raise ValueError(f"the Gemma 3 processor gave {other}: not served")
        pixel_values = processed["pixel_values"]  # [num_images, channels, height, width]
        if pixel_values.shape[0] != len(counts):
            raise ValueError(f"the processor gave {pixel_values.shape[0]} pixel rows for {len(counts)} images "
                             "(pan-and-scan crops, do_pan_and_scan, are not served)")
        return [{"pixel_values": pixel_values[i : i + 1]} for i in range(pixel_values.shape[0])]

    @torch.inference_mode()
    def encode(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = next(self.model.model.vision_tower.parameters())
        pixel_values = data["pixel_values"].to(device=weight.device, dtype=weight.dtype)
        outputs = self.model.get_image_features(pixel_values=pixel_values, return_dict=True)
        return outputs.pooler_output[0]  # [mm_tokens_per_image, hidden_size]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """As the model's forward: an image token past the vocabulary embeds as token 0 (its row is the image's)."""
        if self.image_token_id >= self.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        return super().embed_tokens(input_ids)
