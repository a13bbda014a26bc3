"""A vision-language model's folder (or hub id): loaded with `AutoModelForImageTextToText` and `AutoProcessor`, so
that `paged_hf.LLM(path)` and `paged-hf serve path` serve its images as `wrap(model, processor)` does.

A checkpoint is vision-language when transformers maps its config's model type to image-text-to-text, or its config
has a vision sub-config. Its processor is the one saved beside it (`processor_config.json` with an image processor);
a folder without one is loaded with its tokenizer alone, and its text is served (a warning says so): images need the
processor that made the model's pixel inputs and placeholder tokens, and none is guessed.

Whether a family of paged_hf serves the model's images is decided above this layer (`engine/image_prompts.py`,
`served_processor`), where the families are known.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def is_vision_checkpoint(source) -> bool:
    """Whether the checkpoint's config is a vision-language model's (False when it cannot be read: loading says why)."""
    from transformers import AutoConfig  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: PLC0415

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return False
    return (getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            or getattr(config, "vision_config", None) is not None)


def load_vision_model(source, **kwargs) -> Any:
    """The checkpoint's `AutoModelForImageTextToText` (`kwargs`: from_pretrained's, dtype among them)."""
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415

    return AutoModelForImageTextToText.from_pretrained(source, **kwargs)


def load_processor(source) -> Any:
    """The folder's processor when it has an image processor, else its tokenizer (with a warning: text only)."""
    from transformers import AutoProcessor, AutoTokenizer  # noqa: PLC0415

    try:
        processor = AutoProcessor.from_pretrained(source)
    except Exception as error:  # noqa: BLE001 - e.g. a processor that needs a package not installed (torchvision)
        why = f"its processor does not load ({type(error).__name__}: {error})"
    else:
        if hasattr(processor, "image_processor") and hasattr(processor, "tokenizer"):
            return processor
        why = "it holds no image processor (processor_config.json / preprocessor_config.json)"
    logger.warning("%s is a vision-language model, but %s: only its text is served", source, why)
    return AutoTokenizer.from_pretrained(source)


def is_processor(tokenizer) -> bool:
    """Whether `load_model` gave a multimodal processor (an image processor with a tokenizer) for the tokenizer."""
    return hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer")
