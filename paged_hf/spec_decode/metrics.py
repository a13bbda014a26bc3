"""Counters of speculative decoding, as vLLM's `spec_decode` metrics: drafts, draft tokens, accepted tokens,
and accepted tokens per draft position (position j counts drafts whose first j + 1 tokens were accepted)."""

from __future__ import annotations


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0  # verifications of a request's drafts (one per request and step with drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def as_dict(self) -> dict:
        """The `spec_decode_*` entries of `stats()`."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": rate,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }
