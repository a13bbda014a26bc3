"""Which vision family serves a model, and why a vision-language model that none serves is refused.

A model is vision-language when transformers maps its class to image-text-to-text or its config has a vision
sub-config. Such a model is still served as a text model without a processor (its text path is the language model's);
given a processor, it must be a family of `FAMILIES`, or `wrap()` refuses it naming why: images are never merged in
some other way than the model's own forward does. A checkpoint loaded by path (`LLM`, `paged-hf serve`) whose
images no family serves is wrapped with its processor's tokenizer instead (`served_processor`).
"""

from __future__ import annotations

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from paged_hf.multimodal.family import VisionFamily
from paged_hf.multimodal.gemma3 import Gemma3Family
from paged_hf.multimodal.idefics3 import Idefics3Family
from paged_hf.multimodal.llava import LlavaFamily, VipLlavaFamily
from paged_hf.multimodal.llava_next import LlavaNextFamily
from paged_hf.multimodal.qwen2_vl import Qwen2_5_VLFamily, Qwen2VLFamily

FAMILIES: tuple[type[VisionFamily], ...] = (LlavaFamily, VipLlavaFamily, LlavaNextFamily, Idefics3Family,
                                            Gemma3Family, Qwen2VLFamily, Qwen2_5_VLFamily)
#: why the images of some well-known families are not served yet, beyond "no family"
REASONS: dict[str, str] = {
}


def _image_text_classes() -> set[str]:
    names = set()
    for value in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def is_vision_language(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return type(model).__name__ in _image_text_classes() or getattr(config, "vision_config", None) is not None


def vision_family(model: torch.nn.Module) -> VisionFamily | None:
    """The family that serves the model's images, or None (a text model, or a vision model no family serves)."""
    for family in FAMILIES:
        if family.matches(model):
            return family(model)
    return None


def vision_refusal(model: torch.nn.Module) -> str | None:
    """Why images of this model cannot be served (None when a family serves them, or it is no vision model)."""
    if not is_vision_language(model) or vision_family(model) is not None:
        return None
    served = ", ".join(f"{family.name}" for family in FAMILIES)
    why = REASONS.get(type(model).__name__, "no vision family of paged_hf matches its classes")
    return (f"{type(model).__name__} is a vision-language model whose images paged_hf does not serve yet: {why} "
            f"(served: {served}); wrap it with its tokenizer instead of its processor to serve its text")


def split_processor(tokenizer) -> tuple[object, object | None]:
    """(tokenizer, processor): a multimodal processor (it has an image processor and a tokenizer) gives both."""
    if tokenizer is not None and hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer"):
        return tokenizer.tokenizer, tokenizer
    return tokenizer, None


def served_processor(model: torch.nn.Module, tokenizer) -> tuple[object, str | None]:
    """What to wrap a loaded checkpoint with: `(tokenizer, None)` as given, or, for a processor of a vision-language
    model that no family serves, `(its tokenizer, why)`: its text is served, as `wrap` with the tokenizer serves it."""
    text_tokenizer, processor = split_processor(tokenizer)
    reason = None if processor is None else vision_refusal(model)
    return (tokenizer, None) if reason is None else (text_tokenizer, reason)
