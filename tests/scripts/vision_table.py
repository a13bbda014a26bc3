"""Write docs/vision_models.md: every image-text-to-text architecture transformers ships, as `wrap(model,
processor)` meets it (tests/multimodal/vision_architectures.py), one row each.

    .venv/bin/python tests/scripts/vision_table.py [--output docs/vision_models.md]

About half a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "multimodal")]

import torch  # noqa: E402
import transformers  # noqa: E402
from vision_architectures import STATUSES, classify_vision, vision_architectures  # noqa: E402

INTRO = """\
# Vision-language models

Every image-text-to-text architecture that transformers ships (its `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`),
as `paged_hf.wrap(model, processor)` meets it: built from its default config (on the meta device: the classes and
the config are what `wrap()` reads).

- **served**: a vision family of `paged_hf/multimodal/` recognises its classes exactly; each served family's image
  prompts equal HF's `generate` on the same processor outputs (greedy tokens and top-5 logprobs, float64 tiny
  configs: tests/multimodal/, `docs/vision.md`).
- **refused**: `wrap(model, processor)` raises `UnsupportedModelError` with the reason shown (its text is still
  served when it is wrapped with its tokenizer instead, where the engine serves its language model).

This page is written by `tests/scripts/vision_table.py`; tests/multimodal/test_vision_architectures.py checks
that it is current.
"""


def render(results: dict) -> str:
    counts = collections.Counter(result.status for result in results.values())
    lines = [INTRO, f"Generated {datetime.date.today().isoformat()} with transformers {transformers.__version__} and "
             f"torch {torch.__version__}: {len(results)} architectures.", "",
             "| status | architectures |", "|---|---|"]
    lines += [f"| {status} | {counts[status]} |" for status in STATUSES]
    lines += ["", "| architecture | status | class | family or reason |", "|---|---|---|---|"]
    lines += [f"| {name} | {result.status} | {result.model_class} | {cell(result.detail)} |"
              for name, result in results.items()]
    return "\n".join(lines) + "\n"


def cell(text: str) -> str:
    """One table cell: no pipes, no backticks, one line."""
    return text.replace("|", "/").replace("`", "'").replace("\n", " ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "vision_models.md")
    args = parser.parse_args()
    results = {name: classify_vision(name) for name in vision_architectures()}
    args.output.write_text(render(results))
    print(f"wrote {args.output}: " + ", ".join(f"{s} {sum(r.status == s for r in results.values())}" for s in STATUSES))


if __name__ == "__main__":
    main()
