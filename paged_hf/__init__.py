"""paged_hf: serve any HuggingFace causal LM like vLLM does, without leaving transformers."""

from paged_hf import source_layout

source_layout.register()  # first: paged_hf.kernels and paged_hf.integrations from a checkout's top-level folders

from paged_hf.config import PagedConfig
from paged_hf.engine.generator import ContinuousBatchGenerator
from paged_hf.hf.paged_model import PagedModel, wrap
from paged_hf.llm import LLM
from paged_hf.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from paged_hf.pooling_params import PoolingParams
from paged_hf.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from paged_hf.worker.probes.model_probe import UnsupportedModelError
from paged_hf.worker.paged_cache import PagedCache

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "ContinuousBatchGenerator",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LLM",
    "PagedCache",
    "PagedConfig",
    "PagedModel",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "UnsupportedModelError",
    "wrap",
]
__version__ = "0.1.0"
