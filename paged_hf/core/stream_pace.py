"""A bound on the gap between a stream's tokens: while requests decode, a step carries only as much prefill as
keeps it within `max_stream_gap_s` seconds (PagedConfig; off by default, as vLLM, whose steps never wait).

A decoding request's next token comes out of the next step, whatever else that step computes. With the whole
token budget of prefill in it (a new request's 512-token chunk), that step lasts seconds on a CPU, where a decode
step of the same engine takes tens of milliseconds: every stream stalls for as long as a big prompt is read.
With the bound, a step that carries decodes gives prefill the tokens the fitted step cost (step_pacing.StepCost,
`fixed + per_token * tokens`, timed by the scheduler's StepTimer) says fit in the gap, never fewer than a
sixteenth of the budget (prefill always moves on); a step without decodes still takes the whole budget. The
price is the big prompt's first token, later by the extra steps' fixed cost; throughput with no stream running
is unchanged.
"""

from __future__ import annotations

from paged_hf.core.request import Request
from paged_hf.core.step_pacing import CAPPED_BUDGET_DIVISOR, LEAST_CAP_DIVISOR, StepTimer


def is_prefill(request: Request) -> bool:
    """Whether the request's tokens this step are prompt (or recomputed) tokens rather than one decode."""
    return request.num_tokens_to_compute > 1


class StreamPace:
    def __init__(self, max_stream_gap_s: float, max_num_batched_tokens: int, timer: StepTimer):
        self.max_stream_gap_s = max_stream_gap_s
        self.max_num_batched_tokens = max_num_batched_tokens
        self.timer = timer
        self.least = max(1, max_num_batched_tokens // LEAST_CAP_DIVISOR)
        self.num_paced_steps = 0  # steps whose prefill the bound cut short

    def prefill_allowance(self, running: list[Request]) -> int:
        """The prefill tokens of a step that starts with `running`: the budget when none of them decodes, else
        what keeps the step within the gap (a quarter of the budget before steps of different sizes were timed),
        growing as StepCost.tokens_within allows."""
        num_decodes = sum(1 for r in running if r.num_tokens_to_compute == 1)
        if not num_decodes:
            return self.max_num_batched_tokens
        cost = self.timer.cost
        fit = cost.fit()
        if fit is None:
            return max(self.least, self.max_num_batched_tokens // CAPPED_BUDGET_DIVISOR)
        step_tokens = cost.tokens_within(self.max_stream_gap_s, fit)
        return max(self.least, min(self.max_num_batched_tokens, int(step_tokens) - num_decodes))
