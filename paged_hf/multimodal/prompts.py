"""A prompt with images, in vLLM's shape, -> its token ids and one `MultiModalItem` per image.

vLLM's offline prompts are dicts: `{"prompt": text, "multi_modal_data": {"image": image or [images]}}` or
`{"prompt_token_ids": ids, "multi_modal_data": ...}`. A text prompt goes through the processor exactly as a user
calls it for HF's `generate` (`processor(text=..., images=..., return_tensors="pt")`), so the engine sees the same
token ids and pixels as HF. With token ids, the processor runs on a text of the images' placeholders alone (the same
pixels as with any text); each image's placeholder in the ids is either the single image token (expanded here to
what the processor writes, its `replace_image_token`) or already expanded.

An item's span runs from its first to its last placeholder token; its content hash covers its processed pixels
(`family.content_hash`), which the prefix cache mixes into the hash of every block the span overlaps. A family
whose image tokens attend bidirectionally (`bidirectional_images`, Gemma 3) has each item name its runs of
placeholder tokens (`with_bidirectional_runs`): HF's blocks are exactly those runs. A family whose model places the
prompt's tokens itself (Qwen-VL's 3-D rotary positions) gives their positions here, once (`family.prompt_positions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from paged_hf.core.multimodal import MultiModalItem, MultiModalPositions
from paged_hf.multimodal.family import VisionFamily, content_hash

PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    items: list[MultiModalItem] = field(default_factory=list)
    positions: MultiModalPositions | None = None  # the family's own positions of the prompt (None: its indices)


def prompt_images(prompt: Mapping) -> list:
    """The images of a dict prompt (none without `multi_modal_data`); ValueError for unknown keys or modalities."""
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt keys {unknown} are not served (a prompt dict takes {list(PROMPT_KEYS)})")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids'")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': image}}, got {type(data).__name__}")
    other = sorted(set(data) - {"image"})
    if other:
        raise ValueError(f"multi_modal_data {other}: only 'image' is served")
    images = data.get("image")
    if images is None:
        return []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if any(image is None for image in images):
        raise ValueError("multi_modal_data['image'] holds None")
    return images


class PromptProcessor:
    """Turns dict prompts with images into token ids and items, with the model's processor and vision family."""

    def __init__(self, family: VisionFamily, processor):
        family.check_processor(processor)
        self.family = family
        self.processor = processor

    def process(self, prompt: Mapping, images: list, add_special_tokens: bool | None = None) -> ProcessedPrompt:
        """ValueError for what the processor refuses, or placeholders that do not match the images.
        `add_special_tokens`: the processor's tokenizer keyword (None: its default, as a user's own call)."""
        text = prompt.get("prompt")
        if "prompt" in prompt and not isinstance(text, str):
            raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
        family = self.family
        # token ids: the processor runs on a prompt of the placeholders alone, for the same pixels and expansions
        processor_text = text if text is not None else family.image_token_text(self.processor) * len(images)
        try:
            special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            processed = self.processor(text=processor_text, images=images, return_tensors="pt", **special)
        except Exception as error:  # noqa: BLE001 - the processor's own refusal of this input, named
            raise ValueError(f"the processor refused the prompt's images: {type(error).__name__}: {error}") from None
        token_ids = processed["input_ids"][0].tolist()
        if text is None:
            token_ids = self._expand(_token_id_list(prompt["prompt_token_ids"]), processed, token_ids, len(images))
        counts = family.placeholder_counts(self.processor, processed, token_ids, len(images))
        items = self._items(token_ids, processed, counts)
        return ProcessedPrompt(token_ids, items, family.prompt_positions(token_ids, items))

    def from_model_inputs(self, token_ids: list[int], inputs: Mapping) -> ProcessedPrompt:
        """One prompt's expanded token ids and the processor's image inputs for it, as a user hands them to HF's
        `generate` (`**processor(text=..., images=...)`) -> its items; ValueError when they do not match."""
        family = self.family
        processed = {"input_ids": [token_ids], **inputs}
        num_images = family.num_images(self.processor, processed, token_ids)
        counts = family.placeholder_counts(self.processor, processed, token_ids, num_images)
        if family.bidirectional_images:  # HF's forward attends bidirectionally where its token_type_ids say
            types = inputs.get("token_type_ids")
            if types is None or types.reshape(-1).tolist() != [int(t == family.image_token_id) for t in token_ids]:
                raise ValueError("token_type_ids that mark exactly the image tokens are needed (HF's forward attends "
                                 "bidirectionally among an image's tokens where they say, causally without them)")
        items = self._items(token_ids, processed, counts)
        return ProcessedPrompt(list(token_ids), items, family.prompt_positions(list(token_ids), items))

    def _items(self, token_ids: list[int], processed: Mapping, counts: list[int]) -> list[MultiModalItem]:
        """The prompt's items, each with its bidirectional spans where the family's image tokens see each other."""
        family = self.family
        items = placeholder_items(token_ids, family.image_token_id, counts, family.split(processed, counts))
        if family.bidirectional_images:
            items = with_bidirectional_runs(token_ids, family.image_token_id, items)
        return items

    def _expand(self, token_ids: list[int], processed, expanded_alone: list[int], num_images: int) -> list[int]:
        """Ids with one image token per image -> each replaced by what the processor writes; expanded ids as given."""
        token_id = self.family.image_token_id
        found = token_ids.count(token_id)
        expanded = expanded_alone.count(token_id)
        if found == expanded:
            return token_ids
        if found != num_images:
            raise ValueError(f"prompt_token_ids hold {found} image tokens (id {token_id}) for {num_images} "
                             f"images: give one per image, or the {expanded} the processor writes")
        try:
            replacements = iter([self.family.replacement_ids(self.processor, processed, i) for i in range(num_images)])
        except Exception as error:  # noqa: BLE001 - e.g. a processor whose expansion needs its own call's state
            raise ValueError(f"this processor cannot expand an image token in prompt_token_ids ({error}): give "
                             "the ids it writes (processor(text=..., images=...)['input_ids']) or a text prompt") from None
        out = []
        for token in token_ids:
            out.extend(next(replacements) if token == token_id else [token])
        return out


def _token_id_list(token_ids) -> list[int]:
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) for t in token_ids):
        raise ValueError("prompt_token_ids must be a list of token ids")
    return list(token_ids)


def placeholder_items(token_ids: Sequence[int], token_id: int, counts: list[int], data: list[dict]) -> list[MultiModalItem]:
    """Image i takes the next counts[i] placeholder tokens; its span runs from the first to the last of them."""
    positions = [p for p, token in enumerate(token_ids) if token == token_id]
    if len(positions) != sum(counts) or len(data) != len(counts):
        raise ValueError(f"the prompt holds {len(positions)} image tokens (id {token_id}) where its "
                         f"{len(counts)} images take {sum(counts)}")
    items, start = [], 0
    for count, inputs in zip(counts, data):
        first, last = positions[start], positions[start + count - 1]
        items.append(MultiModalItem(first, last - first + 1, content_hash(inputs), count, inputs))
        start += count
    return items


def with_bidirectional_runs(token_ids: Sequence[int], token_id: int,
                            items: list[MultiModalItem]) -> list[MultiModalItem]:
    """Each item with its runs of placeholder tokens as bidirectional spans (HF's Gemma 3 blocks: a run of image
    tokens sees itself whole). ValueError for a run that two images share (their placeholders touch) or that holds
    the prompt's last token (a chunk must end after a run, and the prompt's last token is computed alone for n > 1)."""
    runs, start = [], None
    for position, token in enumerate([*token_ids, None]):
        if token == token_id and start is None:
            start = position
        elif token != token_id and start is not None:
            runs.append((start, position))
            start = None
    out = []
    for item in items:
        mine = tuple((a, b) for a, b in runs if item.offset <= a < item.end)
        if any(b > item.end for _, b in mine):
            raise ValueError(f"two images' placeholder tokens touch at position {item.end}: HF would let them see "
                             "each other as one image; separate them (the processor frames each image)")
        if any(b == len(token_ids) for _, b in mine):
            raise ValueError("the prompt ends inside an image's placeholder tokens: end it with text (the "
                             "processor frames each image with <end_of_image>)")
        out.append(replace(item, bidirectional=mine))
    return out
