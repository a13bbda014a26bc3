"""Configuration leaves: the engine's `PagedConfig` and speculative decoding's `SpeculativeConfig`."""

from paged_hf.config.engine import PagedConfig
from paged_hf.config.speculative import SpeculativeConfig

__all__ = ["PagedConfig", "SpeculativeConfig"]
