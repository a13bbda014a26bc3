"""Write docs/models.md: every causal-LM architecture transformers ships, classified by the code of
tests/hf/test_architectures.py (tests/hf/architectures.py), one row each.

    .venv/bin/python tests/scripts/architecture_table.py [--output docs/models.md] [model_type ...]

About a minute or two on a 2-core machine. With model types, only those are classified (the page is then partial).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "hf")]

import torch  # noqa: E402
import transformers  # noqa: E402
from architecture_configs import tiny_config  # noqa: E402
from architectures import (MAX_NEW_TOKENS, PROMPT_LENGTHS, STATUSES, TOLERANCE, TOP_LOGPROBS,  # noqa: E402
                           architectures, classify, is_hybrid)

INTRO = """\
# Models

Every causal-LM architecture that transformers ships (its `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), built tiny and
random from its default config, served by `paged_hf.wrap` and compared with the model's own `generate`.

- **equal**: the engine's greedy tokens are HF's (HF's `generate`, one prompt at a time) and every step's
  top-{top} logprobs are within {tolerance:g} of HF's (its full forward over prompt and generated tokens,
  log_softmax in float64), in every dtype of the row: float64 (no argmax tie can hide a difference there) and
  float32 (where the engine takes its fast paths), each where HF's generate runs in it; no KV block leaked.
  Prompts of {lengths} tokens in one batch, {new} new tokens each, block size 4, an 8-token step budget
  (chunked prefill), sliding windows of 8 tokens where the model has them.
- **refused**: `wrap()` raised `ValueError` or `NotImplementedError` with the reason shown.
- **not-a-decoder**: not a decoder-only text model (an encoder-decoder's decoder half, a BERT-like encoder, a
  draft model reading a target's KV, or a generate that is not causal decoding); not served by design.
- **hf-fails**: HF's own generate fails on the tiny model, or disagrees with HF's own forward, in both dtypes:
  there is no reference to compare with.
- **differs**: the engine ran and returned other tokens or logprobs than HF: a bug.
- **error**: `wrap()` or the engine raised something else: a bug (a crash instead of a clear refusal).

A row takes the worst status over its dtypes; a detail that holds for one dtype only starts with that dtype.
**served by** names the engine's code for an equal architecture beyond the model's own forward: the modules of
`paged_hf/worker/families/` whose stand-ins serve it (found by its modules' code), and `hybrid` where recurrent
layers run request by request with a state slot each (`paged_hf/worker/hybrid/`); empty: the model's own code
through the paged attention function.

The tiny configs come from tests/hf/architecture_configs.py (generic rules) and
tests/hf/architecture_overrides.py. This page is written by `tests/scripts/architecture_table.py`; the same
sweep runs in the test suite (tests/hf/test_architectures.py), where `differs` and `error` fail unless listed
as known failures.
"""


def render(results: dict, seconds: float) -> str:
    counts = collections.Counter(result.status for result in results.values())
    lines = [INTRO.format(top=TOP_LOGPROBS, tolerance=TOLERANCE, new=MAX_NEW_TOKENS,
                          lengths=", ".join(map(str, PROMPT_LENGTHS))),
             f"Generated {datetime.date.today().isoformat()} with transformers {transformers.__version__} and "
             f"torch {torch.__version__}: {len(results)} architectures in {seconds:.0f} s.", "",
             "| status | architectures |", "|---|---|"]
    lines += [f"| {status} | {counts[status]} |" for status in STATUSES]
    lines += [""] + [f"{kind.capitalize()} decoders (every status but not-a-decoder and hf-fails): {equal} equal of "
                     f"{total} ({100 * equal / max(total, 1):.1f}%)." for kind, (equal, total) in rates(results).items()]
    lines += ["", "| architecture | status | dtypes | served by | detail |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {result.status} | {result.dtype} | {result.served_by} | {cell(result.detail)} |"
              for name, result in results.items()]
    return "\n".join(lines) + "\n"


def rates(results: dict) -> dict[str, tuple[int, int]]:
    """kind -> (equal, all) over the decoders with a reference (every status but not-a-decoder and hf-fails)."""
    found = {"attention-only": [0, 0], "hybrid or recurrent": [0, 0]}
    for name, result in results.items():
        if result.status in ("not-a-decoder", "hf-fails"):
            continue
        counts = found["hybrid or recurrent" if is_hybrid(name) else "attention-only"]
        counts[0] += result.status == "equal"
        counts[1] += 1
    return {kind: (equal, total) for kind, (equal, total) in found.items()}


def cell(text: str) -> str:
    """One table cell: no pipes, no backticks (details quote error messages)."""
    return text.replace("|", "/").replace("`", "'").replace("\n", " ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "models.md")
    parser.add_argument("model_types", nargs="*", help="only these (default: all)")
    args = parser.parse_args()
    start = time.perf_counter()
    results = {}
    for name in args.model_types or architectures():
        results[name] = classify(name)
        print(f"{name:28s} {results[name].status:14s} {results[name].detail[:90]}", flush=True)
    args.output.write_text(render(results, time.perf_counter() - start))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
