"""What a hybrid model (linear-attention, SSM or convolution layers beside attention) changes in the engine, and
what a sparse-attention model's indexer keys rule out.

Its recurrent layers keep one state per sequence, updated token after token: a prefix-cache hit would need the
state as of the hit, which a block of K/V does not hold (vLLM keeps states at block boundaries for that, its
'align' mode). Here prefix caching is off for hybrid models (a repeated prompt is computed again, with the same
tokens as the first time), and so is the KV tier that extends it. Speculative decoding is refused: a rejected
draft would have to roll the states back.
"""

from __future__ import annotations

from transformers.utils import logging

from paged_hf.config import PagedConfig
from paged_hf.worker.model_info import ModelInfo

logger = logging.get_logger(__name__)


def hybrid_config(config: PagedConfig, info: ModelInfo) -> PagedConfig:
    """The config the engine runs a hybrid model with (the user's own for any other model)."""
    _check_indexer_keys(config, info)
    if not info.is_hybrid:
        return config
    if config.speculative is not None:
        raise ValueError("speculative decoding of a hybrid model (recurrent layers): its states cannot roll back "
                         "rejected drafts; leave `speculative` unset")
    if config.kv_offloading_size or config.kv_cache_dir or config.kv_transfer_config is not None:
        raise ValueError("kv_offloading_size / kv_cache_dir / kv_transfer_config: a hybrid model keeps no prefix "
                         "cache to extend (its recurrent states are not in the KV blocks)")
    if config.enable_prefix_caching:
        logger.info("paged_hf: prefix caching is off for a hybrid model (a cached block does not hold the "
                    "recurrent layers' state as of that block)")
        config = config.replace(enable_prefix_caching=False)
    return config


def _check_indexer_keys(config: PagedConfig, info: ModelInfo) -> None:
    """A sparse-attention model keeps its indexer's keys beside the K/V (worker/indexer_keys.py): what moves K/V
    alone out of the cache is refused for it."""
    if any(layer.indexer_dim for layer in info.attention_layers) and (
            config.kv_offloading_size or config.kv_cache_dir or config.kv_transfer_config is not None):
        raise ValueError("kv_offloading_size / kv_cache_dir / kv_transfer_config: a sparse-attention model keeps "
                         "its indexer's keys beside the K/V (worker/indexer_keys.py), which the KV tier, the disk "
                         "cache and KV transfer do not carry")
