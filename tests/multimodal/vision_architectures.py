"""Every image-text-to-text architecture transformers ships (its `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`), as
`wrap(model, processor)` meets it: served by a vision family of paged_hf, or refused naming why.

Each class is built from its default config on the meta device (no weights: only the classes and the config are
read, as `wrap()` reads them). A served family's equality with HF's `generate` is proven by tests/multimodal (tiny
float64 models with their processors); this sweep proves that every other architecture is refused, never served
by a family that does not know it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from paged_hf.multimodal.registry import FAMILIES, vision_family, vision_refusal

STATUSES = ("served", "refused")


@dataclass
class VisionResult:
    status: str
    model_class: str
    detail: str  # the family that serves it, or the reason wrap() gives


def vision_architectures() -> list[str]:
    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def classify_vision(model_type: str) -> VisionResult:
    class_name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = getattr(transformers, class_name)(transformers.AutoConfig.for_model(model_type))
    except Exception as error:  # noqa: BLE001 - a default config that builds no model, or a missing extra
        # no family names this class (a family recognises its classes exactly), so wrap() refuses any instance
        assert not _class_served(class_name), class_name
        why = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:100]}"
        return VisionResult("refused", class_name, f"no vision family serves {class_name} (its default config "
                                                   f"builds no model here: {why})")
    family = vision_family(model)
    if family is not None:
        return VisionResult("served", class_name, family.name)
    return VisionResult("refused", class_name, vision_refusal(model).split(": ", 1)[1].split(" (served:")[0])


def _class_served(class_name: str) -> bool:
    """Whether a family recognises this class (then its default config must build, to see which family)."""
    return any(outer.__name__ == class_name for family in FAMILIES for outer, _ in family.classes)
