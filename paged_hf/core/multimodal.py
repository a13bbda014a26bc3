"""A prompt's images as the scheduler and the prefix cache see them: where each image's placeholder tokens sit in
the prompt and a hash of its content.

The prefix cache shares a block between requests when its hash matches, and a block's hash chains its tokens.
An image's placeholder tokens are the same token id whatever the image, so a block holding any of them also hashes
the content of the image (or images) whose span overlaps it, as vLLM's multimodal hashes do: the same image at
the same place hits, another image never does. The content hash is taken over the processed pixel tensors (what
the vision tower reads), so two inputs that the processor turns into equal pixels share, and no others.

Some families attend bidirectionally among an image's tokens (Gemma 3: every token of one image sees every other
token of that image). Their items name those spans (`bidirectional`), and two rules follow from them: a step hands
the spans its chunks overlap to the kernels (`step_spans`), and a prefill chunk never ends inside one (`fit_chunk`),
since the span's first tokens would not see its rest: the chunk is cut before the span instead (vLLM's
`disable_chunked_mm_input`), so a span longer than the step's token budget is refused at submission
(`span_over_budget`). A chunk may start inside a span when a prefix-cache hit ends there: the cached keys were
computed with the whole span in one chunk (no chunk ever ended inside it), and their blocks hash the image.

Some families place a prompt's tokens at positions of their own (Qwen-VL's multimodal rotary positions: a temporal,
height and width row per token, an image's tokens on its grid): `MultiModalPositions`, computed once at submission by
the family and kept on the request, from which the family builds each step's position rows.

No torch math here (core is bookkeeping): `data` and `rows` are opaque, the family's own tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image of a prompt. Its embeddings fill the placeholder tokens of [offset, offset + length) (a span may
    hold other tokens too, as some families frame an image with marker tokens; the family says which are filled)."""

    offset: int  # the prompt position of the span's first token
    length: int  # the span's length in tokens
    content_hash: bytes  # a hash of the processed pixels (multimodal/prompts.py)
    num_placeholders: int  # the span's tokens that its embeddings fill, in order (the others are the prompt's own)
    data: Any = field(repr=False)  # the encoder's inputs for this item (the processor's tensors, one image)
    modality: str = "image"
    bidirectional: tuple[tuple[int, int], ...] = ()  # [start, end) prompt spans whose tokens all see each other

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class MultiModalPositions:
    """A prompt's own positions: `rows[:, p]` for prompt token p; a generated token at index p (p >= the prompt's
    length) sits at p + `delta` on every row. Shared by the children of a request (never changed)."""

    rows: Any = field(repr=False)  # [num_rows, num_prompt_tokens] int64 (the family's tensor)
    delta: int  # the generated tokens' offset: the prompt's largest position + 1 - its length

    @property
    def num_prompt_tokens(self) -> int:
        return self.rows.shape[1]


def block_mm_keys(items: Sequence[MultiModalItem], start: int, end: int) -> bytes:
    """The extra hash keys of the token range [start, end) (one block): the offset and content hash of each item
    whose span overlaps it, in prompt order, each length-prefixed like the request's other extra keys."""
    parts = [b"mm:" + item.offset.to_bytes(8, "little") + item.content_hash
             for item in items if item.offset < end and start < item.end]
    return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


def mm_prefill_end(items: Sequence[MultiModalItem]) -> int:
    """The position past the last placeholder: once computed, the request needs no image embeddings any more."""
    return max((item.end for item in items), default=0)


def step_spans(items: Sequence[MultiModalItem], start: int, end: int) -> tuple[tuple[int, int], ...]:
    """The bidirectional spans of a request's items that a chunk of positions [start, end) computes a query of and
    that have a later key for it (longer than one token)."""
    return tuple((a, b) for item in items for a, b in item.bidirectional if a < end and start < b and b - a > 1)


def fit_chunk(items: Sequence[MultiModalItem], start: int, num_new: int) -> int:
    """`num_new` tokens from `start`, cut so that the chunk never ends inside a bidirectional span: before the span
    when the span starts in the chunk, else (the chunk starts inside it, after a prefix hit) to 0: the span's rest
    does not fit this step."""
    end = start + num_new
    for item in items:
        for a, b in item.bidirectional:
            if a < end < b:
                return max(a - start, 0)
    return num_new


def span_over_budget(items: Sequence[MultiModalItem], budget: int) -> tuple[int, int] | None:
    """The first bidirectional span longer than the step's token budget (None: each fits in one chunk)."""
    return next(((a, b) for item in items for a, b in item.bidirectional if b - a > budget), None)
