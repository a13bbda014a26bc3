"""Every causal-LM architecture transformers ships: the engine equals HF (greedy tokens, top-5 logprobs within
1e-3), or refuses it at `wrap()`, or it is not a decoder, or HF itself fails on it (see `architectures.py`).
A silent difference (`differs`) or a crash (`error`) fails the test.

`KNOWN_FAILURES` names the architectures that differ or crash today, each with its cause: they are strict
xfails, so one that starts passing fails the test until it is taken off the list, and one not on the list that
starts to differ or crash fails it too. docs/models.md is the same sweep as a table
(tests/scripts/architecture_table.py writes it): each architecture's status must be the one it documents, so an
architecture the engine stops serving (equal -> refused) fails here, as does a page left stale.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from architectures import architectures, classify

MODELS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"

#: model_type -> why it differs or crashes today (a strict xfail each). Empty: at this commit every architecture
#: is equal, refused, not a decoder or failing in HF itself (docs/models.md). When the engine breaks one that
#: cannot be fixed at once, name it here with its cause.
KNOWN_FAILURES: dict[str, str] = {}


def test_known_failures_name_real_architectures():
    assert not set(KNOWN_FAILURES) - set(architectures())


@pytest.mark.parametrize("model_type", architectures())
def test_architecture_is_equal_refused_or_out_of_scope(model_type, request):
    if model_type in KNOWN_FAILURES:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_FAILURES[model_type], strict=True))
    result = classify(model_type)
    assert result.status not in ("differs", "error"), f"{model_type} {result.status}: {result.detail}"
    documented = documented_statuses().get(model_type)
    assert result.status == documented, (f"{model_type} is {result.status} ({result.detail}), docs/models.md says "
                                         f"{documented}: run tests/scripts/architecture_table.py")


def documented_statuses() -> dict[str, str]:
    """architecture -> status, as docs/models.md's table lists them."""
    rows = re.findall(r"^\| ([\w.-]+) \| ([a-z-]+) \|", MODELS_PAGE.read_text(), flags=re.MULTILINE)
    return {name: status for name, status in rows if name not in ("status", "architecture")}
