"""What the engine hands back: cumulative outputs per request, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
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
