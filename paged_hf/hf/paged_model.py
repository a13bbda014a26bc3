"""`paged_hf.wrap(model)` -> `PagedModel`: HF's `generate` served by the engine; everything else untouched."""

from __future__ import annotations

import torch
from transformers.utils import logging

from paged_hf.config import PagedConfig
from paged_hf.engine.generator import ContinuousBatchGenerator
from paged_hf.loader.quantized import quantize_model

logger = logging.get_logger(__name__)


class PagedModel:
    """A thin proxy: `generate` goes through the engine, every other attribute and call reaches the model."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: PagedConfig | None = None):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "tokenizer", tokenizer)
        object.__setattr__(self, "generator", ContinuousBatchGenerator(model, config, tokenizer))

    def generate(self, *args, **kwargs):
        """Same arguments and return value as `model.generate`; what the engine cannot serve (beam
        sampling, assisted decoding, ...) falls back to the model's own `generate` with a one-time warning."""
        from paged_hf.hf.generate import paged_generate  # noqa: PLC0415

        if self.generator.serves_peft_model:
            # a PeftModel's generate applies its active adapter(s), which the drop-in path does not route yet;
            # its adapters are served by name through `generator` (adapter=...)
            logger.warning_once("paged_hf: generate() of a wrapped PeftModel falls back to peft's own generate; "
                                "use pm.generator with adapter names for the engine")
            return self._model.generate(*args, **kwargs)
        return paged_generate(self, *args, **kwargs)

    def unwrap(self) -> torch.nn.Module:
        """The original model, exactly as it was before `wrap()`."""
        return self._model

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._model, name, value)

    def __repr__(self) -> str:
        return f"PagedModel({self._model.__class__.__name__}, {self.generator.stats()['num_blocks']} blocks)"


def wrap(model: torch.nn.Module, tokenizer=None, **config) -> PagedModel:
    """Serve `model` with a paged KV cache and continuous batching. `config`: the `PagedConfig` fields.
    `quantization="int8"` replaces the model's float linears by int8 ones first, in place (their float weights
    are freed: `unwrap()` then gives the quantized model)."""
    config = PagedConfig.from_kwargs(**config)
    if config.quantization is not None:
        quantize_model(model, config.quantization)
    return PagedModel(model, tokenizer, config)
