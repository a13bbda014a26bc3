"""What a vision family says about its model: its placeholder token, how a processor's output splits into one
image's encoder inputs, how many placeholders an image takes, how the vision tower and projector turn one
image into the rows that fill them (`encode`), and, for a model that places a prompt's tokens at positions of its own
(Qwen-VL's 3-D rotary positions), those positions (`prompt_positions`) and a step's position rows from them
(`step_position_ids`).

A family runs the model's own methods (`get_image_features`, the input embeddings), so the features are what the
model's forward would merge; the engine only decides when (once per image, in the step that first needs it) and
where (the placeholder rows of that step's packed row).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from paged_hf.core.multimodal import MultiModalItem, MultiModalPositions
from paged_hf.core.scheduler_output import SchedulerOutput


class VisionFamily:
    """One family's answers; a subclass per family (`llava.py`), chosen by `registry.vision_family`."""

    name = ""
    encoder_modules: tuple[str, ...] = ()  # module paths of the vision tower and projector (what `encode` runs)
    #: (model class, its inner model's class): recognised exactly, so a subclass whose forward merges images
    #: otherwise is never taken for a family's model
    classes: tuple[tuple[type, type], ...] = ()
    # each run of an image's placeholder tokens attends bidirectionally (Gemma 3): its items name the runs as
    # bidirectional spans (core/multimodal.py), which the scheduler keeps whole and the kernels unmask
    bidirectional_images = False

    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        inner_model = getattr(model, "model", None)
        return any(type(model) is outer and type(inner_model) is inner for outer, inner in cls.classes)

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.image_token_id: int = model.config.image_token_id

    def split(self, processed: Mapping, counts: list[int]) -> list[dict[str, torch.Tensor]]:
        """The processor's batched image tensors -> one dict of encoder inputs per image, in prompt order
        (`counts`: each image's placeholder tokens)."""
        raise NotImplementedError

    def replacement_ids(self, processor, processed: Mapping, index: int) -> list[int]:
        """The tokens the processor writes in place of image `index`'s placeholder (its `replace_image_token`)."""
        text = processor.replace_image_token(processed, image_idx=index)
        return processor.tokenizer(text, add_special_tokens=False)["input_ids"]

    def placeholder_counts(self, processor, processed: Mapping, token_ids: list[int], num_images: int) -> list[int]:
        """How many placeholder tokens each image takes in `token_ids` (the processor's expanded prompt)."""
        return [self.replacement_ids(processor, processed, i).count(self.image_token_id) for i in range(num_images)]

    def num_images(self, processor, processed: Mapping, token_ids: list[int]) -> int:
        """How many images a processor's outputs for one prompt hold (one row of `pixel_values` each)."""
        return processed["pixel_values"].shape[0]

    def image_token_text(self, processor) -> str:
        """The placeholder as text in a prompt (what the user writes where an image goes)."""
        return processor.image_token

    def check_processor(self, processor) -> None:
        """ValueError when the processor's placeholder is not the model's."""
        token_id = getattr(processor, "image_token_id", None)
        if token_id != self.image_token_id:
            raise ValueError(f"the processor's image token id {token_id} is not the model's "
                             f"config.image_token_id {self.image_token_id}: a processor of another model?")

    @torch.inference_mode()
    def encode(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """-> [num_embeds, hidden_size]: the rows that fill the image's placeholders, in order (pixels cast to the
        vision tower's dtype and device, as a user casts them for HF's generate)."""
        raise NotImplementedError

    def prompt_positions(self, token_ids: list[int], items: Sequence[MultiModalItem]) -> MultiModalPositions | None:
        """A prompt's own positions, computed once at submission (None: a token's position is its index, as for
        every family whose model counts tokens); ValueError for a prompt the model could not place."""
        return None

    def step_position_ids(self, out: SchedulerOutput, positions: torch.Tensor) -> torch.Tensor | None:
        """The step's `position_ids` when a request of it holds its own positions (None: the packed row's token
        indices `positions` [num_tokens], as for a text model)."""
        return None

    def encoder_lora_modules(self, module_paths) -> list[str]:
        """Of a LoRA adapter's module paths, those in the vision tower or projector: the engine applies an adapter
        in the language model's steps only, so images must not meet such an adapter."""
        return sorted(p for p in module_paths if any(p == m or p.startswith(m + ".") for m in self.encoder_modules))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, num_tokens] -> [1, num_tokens, hidden_size]: the token embeddings, as the model's forward takes them."""
        return self.model.get_input_embeddings()(input_ids)


def content_hash(data: Mapping[str, torch.Tensor]) -> bytes:
    """A hash of one image's encoder inputs (names, dtypes, shapes and bytes): equal hashes, equal features."""
    digest = hashlib.blake2b(b"paged_hf-mm/1", digest_size=16)
    for name in sorted(data):
        tensor = data[name].detach().cpu().contiguous()
        header = f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode()
        digest.update(len(header).to_bytes(4, "little") + header)
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()
