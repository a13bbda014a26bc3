"""A step's input embeddings when some of its requests hold images: the token embeddings of the packed row, with
each image's features over the placeholder rows that this step computes.

An image is encoded once, in the step that first reaches one of its placeholders (unless the engine's encoder-output
cache holds its features already: encoder_cache.py), and its features are kept on the request
(`request.mm_features`) until the request has computed its last placeholder: a chunked prefill that cuts through an
image takes the next rows of the same features in the next step, never encodes it again. A request preempted after
that point recomputes its prompt, and its images with it, from zero (their features from the encoder cache where it
still holds them).

The vision tower runs before the step's forward, outside the step's swaps: its attention layers are the model's
own, not paged.
"""

from __future__ import annotations

import torch

from paged_hf.core.multimodal import MultiModalItem, mm_prefill_end
from paged_hf.core.request import Request
from paged_hf.core.scheduler_output import SchedulerOutput
from paged_hf.multimodal.encoder_cache import EncoderCache
from paged_hf.multimodal.family import VisionFamily


def has_images(out: SchedulerOutput) -> bool:
    """Whether a request of the step computes any of its placeholders."""
    return any(_overlapping(s.request, s.request.num_computed_tokens, s.num_new_tokens) for s in out.scheduled)


def _overlapping(request: Request, start: int, num_new: int) -> list[tuple[int, MultiModalItem]]:
    end = start + num_new
    return [(i, item) for i, item in enumerate(request.mm_items) if item.offset < end and start < item.end]


@torch.inference_mode()
def step_embeds(family: VisionFamily, out: SchedulerOutput, input_ids: torch.Tensor,
                query_start_loc: list[int], cache: EncoderCache | None = None) -> torch.Tensor:
    """input_ids [1, num_tokens] (the packed row) -> inputs_embeds [1, num_tokens, hidden_size]. `cache`: the
    engine's encoder-output cache (an image found there is not encoded again)."""
    embeds = family.embed_tokens(input_ids)
    for row_start, scheduled in zip(query_start_loc, out.scheduled):
        request = scheduled.request
        start = request.num_computed_tokens
        for index, item in _overlapping(request, start, scheduled.num_new_tokens):
            features = request.mm_features.get(index)
            if features is None:
                features = request.mm_features[index] = _features(family, item, embeds.device, cache)
            rows, feature_rows = _placements(family, request, item, start, scheduled.num_new_tokens)
            embeds[0, rows + row_start] = features[feature_rows].to(embeds.dtype)
        if start + scheduled.num_new_tokens >= mm_prefill_end(request.mm_items):
            request.mm_features.clear()  # every placeholder is computed: the features are not needed again
    return embeds


def _features(family: VisionFamily, item: MultiModalItem, device: torch.device,
              cache: EncoderCache | None) -> torch.Tensor:
    """The item's features: from the encoder-output cache by its content hash, else encoded (and kept there)."""
    features = cache.get(item.content_hash) if cache is not None else None
    if features is None:
        features = _encode(family, item, device)
        if cache is not None:
            cache.put(item.content_hash, features)
    return features


def _encode(family: VisionFamily, item: MultiModalItem, device: torch.device) -> torch.Tensor:
    features = family.encode(item.data)  # [num_embeds, hidden_size]
    if features.shape[0] != item.num_placeholders:  # the model's own forward refuses this too
        raise ValueError(f"an image gave {features.shape[0]} feature rows for its {item.num_placeholders} "
                         "placeholder tokens: the processor does not match the model")
    return features.to(device)


def _placements(family: VisionFamily, request: Request, item: MultiModalItem, start: int,
                num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rows of the request's chunk, rows of the item's features) of the placeholders in the chunk: the k-th
    placeholder token of the item's span takes its k-th feature row."""
    span = torch.tensor(request.all_token_ids[item.offset : item.end])
    is_placeholder = span == family.image_token_id  # [length]
    feature_index = is_placeholder.cumsum(0) - 1
    lo, hi = max(start, item.offset), min(start + num_new, item.end)
    chunk = torch.arange(lo, hi) - item.offset  # span positions within this chunk
    chunk = chunk[is_placeholder[chunk]]
    return chunk + item.offset - start, feature_index[chunk]
