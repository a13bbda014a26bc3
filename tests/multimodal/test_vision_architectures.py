"""Every image-text-to-text architecture transformers ships is served by a vision family or refused at `wrap()`
naming why (vision_architectures.py), as docs/vision_models.md lists it; and every family is among the tiny models
that test_images.py compares with HF's `generate`, so no family is served without that proof."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_images import TINY_VLMS
from vision_architectures import classify_vision, vision_architectures

from paged_hf.multimodal.registry import FAMILIES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "vision_models.md"


def documented() -> dict[str, tuple[str, str]]:
    """architecture -> (status, family or reason), as the page lists them."""
    rows = re.findall(r"^\| ([\w.-]+) \| (served|refused) \| \w+ \| (.*) \|$", PAGE.read_text(), flags=re.MULTILINE)
    return {name: (status, detail) for name, status, detail in rows}


@pytest.mark.parametrize("model_type", vision_architectures())
def test_architecture_is_served_or_refused_as_documented(model_type):
    result = classify_vision(model_type)
    assert result.status in ("served", "refused") and result.detail
    page = documented().get(model_type)
    assert page is not None and page[0] == result.status, (
        f"{model_type} is {result.status} ({result.detail}), docs/vision_models.md says {page}: "
        "run tests/scripts/vision_table.py")


def test_every_family_is_compared_with_hf():
    assert {family.name for family in FAMILIES} <= set(TINY_VLMS)
