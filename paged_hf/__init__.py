"""paged_hf: serve any HuggingFace causal LM like vLLM does, without leaving transformers."""

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .config import PagedConfig
from .generator import ContinuousBatchGenerator
from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .paged_cache import PagedCache
from .paged_model import PagedModel, wrap
from .sampling_params import SamplingParams
from .structured_output import StructuredOutputsParams

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "ContinuousBatchGenerator",
    "LLM",
    "PagedCache",
    "PagedConfig",
    "PagedModel",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "wrap",
]
__version__ = "0.1.0"
