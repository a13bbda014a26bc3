"""`PoolingParams`: what an embedding request asks for (vLLM's name). Passed where `SamplingParams` would be,
it makes the request prefill-only: the prompt is computed in the engine's ordinary steps, beside generation
requests, and pooled into one vector; nothing is sampled."""

from __future__ import annotations

from dataclasses import dataclass

from paged_hf.utils import field_checker

_check = field_checker("PoolingParams")


@dataclass
class PoolingParams:
    """`dimensions`: keep the first `dimensions` values (Matryoshka truncation; normalized after it when the
    vector is normalized). `normalize`: None follows the model's sentence-transformers config (a `Normalize`
    module), True/False overrides it."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        _check(self.dimensions is None or (isinstance(self.dimensions, int) and not isinstance(self.dimensions, bool)
                                           and self.dimensions >= 1), "dimensions", self.dimensions, "an int >= 1")
        _check(self.normalize is None or isinstance(self.normalize, bool), "normalize", self.normalize,
               "a bool or None")

    @property
    def n(self) -> int:
        """One vector per request (callers that count a request's sequences read `n`)."""
        return 1
