"""A vision-language model's folder (or hub id): loaded with `AutoModelForImageTextToText` and `AutoProcessor`, so
that `paged_hf.LLM(path)` and `paged-hf serve path` serve its images as `wrap(model, processor)` does.

A checkpoint is vision-language when transformers maps its config's model type to image-text-to-text, or its config
has a vision sub-config. Its processor is the one saved beside it (`processor_config.json` with an image processor);
a folder without one is loaded with its tokenizer alone, and its text is served (a warning says so): images need the
processor that made the model's pixel inputs and placeholder tokens, and none is guessed.

`load_model` loads the model (its image-text-to-text class where no causal-LM class loads it) and the tokenizer;
`default_model.with_processor` (what `LLM` and `paged-hf serve` call after it) gives the folder's processor for the
tokenizer. Whether a family of paged_hf serves the model's images is decided above this layer
(`multimodal/registry.py`, `served_processor`), where the families are known.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def vision_checkpoint(source) -> tuple[bool, bool]:
    """(vision-language, needs the image-text-to-text class) of a checkpoint's config: the second where no causal-LM
    class loads it (LLaVA, Idefics3; Gemma 3's causal-LM class is its vision class already, Llama 4's and Qwen3.5's
    are text models, loaded as before). (False, False) when the config cannot be read: loading says why."""
    from transformers import AutoConfig  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,  # noqa: PLC0415
                                                         MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return False, False
    model_type = getattr(config, "model_type", None)
    vision = model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or getattr(config, "vision_config", None) is not None
    return vision, vision and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


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
