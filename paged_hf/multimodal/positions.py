"""A step's position rows when some of its requests hold positions of their own (`core.multimodal.MultiModalPositions`,
Qwen-VL's temporal, height and width rotary positions): each such request's rows of the tokens it computes this
step, the token indices on every row for the others (a text-only request batched with images).

The prompt's rows were computed once at submission by the family (the model's own `get_rope_index`); a generated
token at index p sits at p + delta on every row, as in HF's `generate`. Whatever cuts the prompt into steps (chunked
prefill, a prefix-cache hit that starts mid-prompt or mid-image, a resume after preemption that recomputes the
generated tokens too, the children of n > 1 computing the last prompt token each) only chooses which columns a step
takes.
"""

from __future__ import annotations

import torch

from paged_hf.core.multimodal import MultiModalPositions
from paged_hf.core.scheduler_output import SchedulerOutput


def step_position_rows(out: SchedulerOutput, positions: torch.Tensor, num_rows: int) -> torch.Tensor | None:
    """positions [num_tokens] (the packed row's token indices) -> [num_rows, num_tokens]; None when no request of
    the step holds positions of its own (the step's positions are then its token indices, as for a text model)."""
    if not any(scheduled.request.mm_positions is not None for scheduled in out.scheduled):
        return None
    rows = positions.expand(num_rows, -1).clone()  # [num_rows, num_tokens]
    first = 0
    for scheduled in out.scheduled:  # the packed row holds each request's new tokens in this order
        request, count = scheduled.request, scheduled.num_new_tokens
        own, start = request.mm_positions, request.num_computed_tokens
        if own is not None and start >= own.num_prompt_tokens:  # generated tokens only (a decode): indices + delta
            rows[:, first : first + count] += own.delta
        elif own is not None:
            rows[:, first : first + count] = request_rows(own, start, count)
        first += count
    return rows


def request_rows(own: MultiModalPositions, start: int, count: int) -> torch.Tensor:
    """[num_rows, count]: the positions of a request's tokens [start, start + count)."""
    end, num_prompt = start + count, own.num_prompt_tokens
    prompt = own.rows[:, start : min(end, num_prompt)]  # [num_rows, prompt tokens of the range]
    generated = torch.arange(start + prompt.shape[1], end, dtype=prompt.dtype) + own.delta  # generated tokens of it
    return torch.cat([prompt, generated.expand(prompt.shape[0], -1)], dim=1)
