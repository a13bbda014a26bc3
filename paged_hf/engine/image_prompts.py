"""The engine's side of images: `wrap(model, processor)` takes a processor where a tokenizer goes, and a prompt
dict with `multi_modal_data` becomes token ids and items (`multimodal/prompts.py`).

Refused at `wrap()`, naming why: a processor for a vision-language model that no vision family serves. Refused
per request (a ValueError at submission): images without a processor, and images with what this engine does not
serve with them yet (speculative decoding, a pipeline of stages: their other ranks and draft models see token ids
only), and an image whose tokens attend to each other (Gemma 3) that is longer than the step's token budget: such an
image is computed in one chunk (core/multimodal.py), so it could never be.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from paged_hf.core.multimodal import span_over_budget
from paged_hf.multimodal.prompts import ProcessedPrompt, PromptProcessor, prompt_images
from paged_hf.multimodal.registry import vision_family, vision_refusal
from paged_hf.worker.probes.model_probe import UnsupportedModelError


def prompt_processor(model: torch.nn.Module, processor) -> PromptProcessor | None:
    """The model's prompt processor (None without a processor); UnsupportedModelError when no family serves the
    images of this vision-language model, ValueError for a processor that is not the model's."""
    if processor is None:
        return None
    reason = vision_refusal(model)
    if reason is not None:
        raise UnsupportedModelError(reason)
    family = vision_family(model)
    if family is None:
        raise ValueError(f"a processor was given for {type(model).__name__}, which is no vision-language model: "
                         "pass its tokenizer instead")
    return PromptProcessor(family, processor)


def prompt_and_items(engine, prompt) -> ProcessedPrompt:
    """Any prompt -> its checked token ids, image items and the family's own positions of it (no items nor positions
    but for a prompt dict with images, or what `processed_prompt` made of one)."""
    if isinstance(prompt, ProcessedPrompt):
        if prompt.items and not_served(engine) is not None:
            raise ValueError(f"images are not served {not_served(engine)}")
        processed = prompt
    elif not isinstance(prompt, Mapping):
        return ProcessedPrompt(engine.prompt_token_ids(prompt))
    else:
        processed = process_prompt(prompt, engine.prompt_processor, engine.tokenizer, not_served(engine))
    check_span_budget(processed.items, engine.config.max_num_batched_tokens)
    return ProcessedPrompt(engine.prompt_token_ids(processed.token_ids), processed.items, processed.positions)


def check_span_budget(items: list, budget: int) -> None:
    """ValueError for an image whose tokens attend to each other (one chunk) that the token budget cannot hold."""
    span = span_over_budget(items, budget)
    if span is not None:
        raise ValueError(f"an image of {span[1] - span[0]} tokens that attend to each other must be computed in one "
                         f"step, and the step's token budget max_num_batched_tokens is {budget}: raise it to at least "
                         f"{span[1] - span[0]}")


def processed_prompt(engine, prompt: Mapping, add_special_tokens: bool | None = None) -> ProcessedPrompt:
    """Thread-safe (a server's worker thread): a prompt dict -> its token ids and image items, the processor's
    work done on the calling thread; `add_request` takes the result as its prompt. `add_special_tokens`: the
    processor's tokenizer keyword (None: its default). ValueError for what `add_request` would refuse."""
    if not isinstance(prompt, Mapping):
        raise ValueError(f"a prompt dict is expected, got {type(prompt).__name__}")
    return process_prompt(prompt, engine.prompt_processor, engine.tokenizer, not_served(engine), add_special_tokens)


def not_served(engine) -> str | None:
    """Why this engine takes no images whatever its model (None: it takes them with a processor)."""
    return ("with speculative decoding" if engine.speculator is not None else
            "pipeline-parallel" if engine.runner.links is not None else None)


def check_adapter(family, lora, mm_items: list) -> None:
    """ValueError for images with an adapter that has LoRA weights in the vision tower or projector: the engine
    routes an adapter through the language model's steps only, so those images would be encoded without it."""
    if family is None or lora is None or not mm_items:
        return
    modules = family.encoder_lora_modules(lora.weights)
    if modules:
        raise ValueError(f"adapter {lora.name!r} has LoRA weights in the vision encoder ({modules[0]}, ...), which "
                         "paged_hf does not apply to images yet: use it for text prompts, or an adapter of the "
                         "language model only")


def process_prompt(prompt: Mapping, processor: PromptProcessor | None, tokenizer, not_served: str | None,
                   add_special_tokens: bool | None = None) -> ProcessedPrompt:
    """A prompt dict -> its token ids and image items. `not_served`: why this engine takes no images, or None;
    `add_special_tokens`: the tokenizer's keyword (None: its default)."""
    images = prompt_images(prompt)
    if not images:
        text = prompt.get("prompt")
        if text is not None:
            if not isinstance(text, str) or tokenizer is None:
                raise ValueError("'prompt' must be a string, and a text prompt needs a tokenizer")
            special = True if add_special_tokens is None else add_special_tokens
            return ProcessedPrompt(tokenizer(text, add_special_tokens=special)["input_ids"])
        ids = prompt["prompt_token_ids"]
        return ProcessedPrompt(ids.tolist() if hasattr(ids, "tolist") else ids)
    if processor is None:
        raise ValueError("a prompt with images needs the model's processor: wrap(model, processor)")
    if not_served is not None:
        raise ValueError(f"images are not served {not_served}")
    return processor.process(prompt, images, add_special_tokens)
