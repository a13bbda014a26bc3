"""Embeddings: which rows of the packed row a request's pooling reads, the capture of the model's final
hidden states at those rows only, and the pooling itself.

The hidden states are the base module's output (what sentence-transformers' Transformer module returns as
`token_embeddings`: after the final norm, before `lm_head`), captured by a forward hook for one forward.
A prompt computed over several steps (chunked prefill) hands its rows over step by step; mean and max
pooling read every prompt token, so such requests never read the prefix cache (see `Request.pools_every_token`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_hf.core.scheduler_output import SchedulerOutput


@dataclass
class PoolingSpan:
    """Rows [row, row + count) of this step's packed row hold positions [position, position + count) of the
    embedding request; `completes`: this step computes its last prompt token, so it is pooled after it."""

    request: object  # core.request.Request
    row: int
    position: int
    count: int
    completes: bool


def pooled_positions(pooling_type: str, start: int, end: int, num_prompt_tokens: int) -> tuple[int, int]:
    """Of the positions [start, end) computed this step, those the pooling reads -> (first position, count)."""
    if pooling_type in ("mean", "max"):
        return start, end - start
    if pooling_type == "cls":
        return (0, 1) if start == 0 else (start, 0)
    assert pooling_type == "lasttoken", pooling_type
    last = num_prompt_tokens - 1
    return (last, 1) if start <= last < end else (start, 0)


def pooling_spans(out: SchedulerOutput, query_start_loc: list[int]) -> list[PoolingSpan]:
    """The embedding requests' spans of this step (before the scheduler advances them): the rows their pooling
    reads, and those that complete a prompt even when they read none (cls pooling after the first chunk)."""
    spans = []
    for scheduled, first_row in zip(out.scheduled, query_start_loc):
        request = scheduled.request
        if request.pooling is None:
            continue
        start = request.num_computed_tokens
        position, count = pooled_positions(request.pooling, start, start + scheduled.num_new_tokens,
                                           request.num_prompt_tokens)
        if count or scheduled.samples:
            spans.append(PoolingSpan(request, first_row + position - start, position, count, scheduled.samples))
    return spans


def pool(pooling_type: str, hidden_states: torch.Tensor) -> torch.Tensor:
    """[num_read_tokens, hidden_size] (every row the pooling read, in position order) -> [hidden_size] float32."""
    hidden_states = hidden_states.float()
    if pooling_type == "mean":
        return hidden_states.mean(dim=0)
    if pooling_type == "max":
        return hidden_states.max(dim=0).values
    return hidden_states[-1] if pooling_type == "lasttoken" else hidden_states[0]


def finish_vector(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> list[float]:
    """Matryoshka truncation to `dimensions`, then L2 normalization (as sentence-transformers' Normalize)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=0)
    return vector.tolist()


def base_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the final hidden states (LlamaModel in LlamaForCausalLM); ValueError if the
    model has none apart from itself."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise ValueError(f"{type(model).__name__} has no base module (its `base_model_prefix` names none): "
                         f"the hidden states before lm_head cannot be read for embeddings")
    return base


class HiddenStateCapture:
    """For one forward: keeps the base module's output at `rows` of the packed row ([num_rows, hidden_size])."""

    def __init__(self, model: torch.nn.Module, rows: torch.Tensor):
        self.module = base_module(model)
        self.rows = rows  # [num_rows] int64
        self.hidden_states: torch.Tensor | None = None

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self._keep)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _keep(self, module, args, output) -> None:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        self.hidden_states = hidden[0, self.rows.to(hidden.device)]  # [num_rows, hidden_size]


def pooling_rows(spans: list[PoolingSpan]) -> torch.Tensor:
    """The packed-row indices every span reads, span after span: [num_rows] int64."""
    rows = [row for span in spans for row in range(span.row, span.row + span.count)]
    return torch.tensor(rows, dtype=torch.long)
