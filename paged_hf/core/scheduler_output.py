"""What the scheduler decides for one step, as the engine and the model runner read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_hf.core.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose K/V this step computes, starting at request.num_computed_tokens
    num_spec_tokens: int = 0  # of which drafts (request.spec_token_ids) after its last token: speculative decoding

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so its logits give the next token."""
        num_real = self.num_new_tokens - self.num_spec_tokens
        return self.request.num_computed_tokens + num_real == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # copy-on-write: the runner copies block src to block dst (every layer's K and V) before the forward
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # forks of a hybrid model's requests: the runner copies recurrent-state slot src to dst before the forward
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
