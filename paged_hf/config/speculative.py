"""`SpeculativeConfig`: vLLM's `speculative_config` (method, num_speculative_tokens, prompt lookup bounds, draft model).

Given as `PagedConfig.speculative` (a dict or a SpeculativeConfig) or `--speculative-config '{JSON}'` on the
command line, with vLLM's field names.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

import torch

from paged_hf.utils import config_fields, is_int

METHODS = ("ngram", "draft_model")
#: measured on a 2-core CPU with the default model (docs/speculative_decoding.md): a step's cost stays
#: near flat up to ~32 tokens, so drafts are spread over the running requests within this many tokens
DEFAULT_MAX_VERIFY_TOKENS = 32
#: measured by replaying the grounded workload's greedy outputs through the proposer (docs/speculative_decoding.md):
#: drafting 2 tokens per matched token cuts the wasted drafts of 1-token matches and keeps long matches' drafts
DEFAULT_SPEC_FACTOR = 2.0


@dataclass
class SpeculativeConfig:
    """`method`: "ngram" (prompt lookup: match the last prompt_lookup_min..max tokens against the prompt and
    output so far, propose the k tokens that followed) or "draft_model" (`model`: a smaller causal LM with the
    same vocabulary, a path / hub id or a live HF model, proposes k tokens greedily). `num_speculative_tokens`:
    k, drafts per request and step at most. `prompt_lookup_spec_factor` (ngram): a match of n tokens drafts at
    most ceil(factor * n) of the k (null: always k, as vLLM's ngram). Policy (when speculation pays): a step
    verifies at most `max_verify_tokens` tokens of decoding requests (their last token plus drafts), so with
    many running requests each gets fewer drafts, and none once every request's own token fills it;
    `disable_by_batch_size` (vLLM's option): no drafts at all while more requests than this are running."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_spec_factor: float | None = DEFAULT_SPEC_FACTOR
    max_verify_tokens: int = DEFAULT_MAX_VERIFY_TOKENS
    disable_by_batch_size: int | None = None
    model: object = None  # draft_model: a folder, a hub id or a live HF causal LM (torch.nn.Module)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {list(METHODS)}, got {self.method!r}")
        if self.method == "draft_model":
            self._check_draft_model()
        else:
            self._fill_prompt_lookup()
        for name in ("num_speculative_tokens", "max_verify_tokens"):
            _check_int(name, getattr(self, name))
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size)

    def _fill_prompt_lookup(self) -> None:
        if self.model is not None:
            raise ValueError(f"speculative config model={self.model!r} is for method 'draft_model', not {self.method!r}")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5  # vLLM's defaults
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _check_int(name, getattr(self, name))
        factor = self.prompt_lookup_spec_factor
        if factor is not None and not (isinstance(factor, (int, float)) and not isinstance(factor, bool)
                                       and math.isfinite(factor) and factor > 0):
            raise ValueError(f"speculative config prompt_lookup_spec_factor must be a number > 0 or null, "
                             f"got {factor!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} is larger than "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    def _check_draft_model(self) -> None:
        if self.model is None:
            raise ValueError("speculative method 'draft_model' needs a model: a folder, a hub id or an HF model")
        if not isinstance(self.model, (str, os.PathLike, torch.nn.Module)) or self.model == "":
            raise ValueError(f"speculative config model must be a folder, a hub id or an HF model, got {self.model!r}")
        given = [name for name in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, name) is not None]
        if given:
            raise ValueError(f"speculative config {given} apply to method 'ngram' only, not 'draft_model'")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict or a JSON object text (the CLI's form) -> SpeculativeConfig."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**config_fields(value, "speculative config", {f.name for f in fields(cls)}))


def _check_int(name: str, value) -> None:
    if not (is_int(value) and value >= 1):
        raise ValueError(f"speculative config {name} must be an int >= 1, got {value!r}")
