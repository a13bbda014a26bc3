"""What the engine hands back: cumulative outputs per request, as in vLLM."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a sequence ended (vLLM's names). A str: it compares, formats and serializes as its value."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or max_model_len
    ABORT = "abort"  # aborted by the caller, or failed alone

    def __str__(self) -> str:
        return self.value


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: FinishReason | None = None  # None while running
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS/length


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    error: str | None = None  # this request failed inside the engine (finished, finish_reason "abort"); others ran on
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # vLLM's: prompt tokens found in the prefix cache or the KV tier when the request was first scheduled
    num_cached_tokens: int = 0
    # vLLM's: what a KV consumer needs to find this prompt's blocks (a kv_producer's finished requests)
    kv_transfer_params: dict | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # pooled, truncated to `dimensions` if asked, then normalized as the model's config says


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's one output (vLLM's shape: `output.outputs.embedding`), given once it finished."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None  # None when it was aborted or failed
    finished: bool = True
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    error: str | None = None


@dataclass
class BeamSearchSequence:
    """One returned hypothesis. `tokens` holds the prompt too (as vLLM's); `score` is HF's sequences_scores."""

    tokens: list[int]
    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: FinishReason  # STOP (EOS or a stop token, included in the tokens) or LENGTH
    text: str | None = None
    beam_indices: list[int] = field(default_factory=list, repr=False)  # per token, the beam row it extended


@dataclass
class BeamSearchOutput:
    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first
