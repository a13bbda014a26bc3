"""Configuration leaves: the engine's `PagedConfig`, speculative decoding's `SpeculativeConfig` and
disaggregated prefill/decode's `KVTransferConfig`."""

from paged_hf.config.engine import PagedConfig
from paged_hf.config.kv_transfer import KVTransferConfig
from paged_hf.config.speculative import SpeculativeConfig

__all__ = ["KVTransferConfig", "PagedConfig", "SpeculativeConfig"]
