"""Prompt lookup (vLLM's `ngram` proposer): the text a request restates or edits is already in its context.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are searched for in the request's
earlier tokens (prompt and output); at the first (earliest) match, the k tokens that followed it are the
proposal. No model, no state: a few vectorized comparisons per request and step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .proposer import Proposer


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_batch(self, requests: list, num_drafts: list[int]) -> list[list[int]]:
        return [self.propose(request.all_token_ids, k) for request, k in zip(requests, num_drafts)]

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (fewer, or none, when nothing matches)."""
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # windows start at 0 .. num_tokens - n - 1: each has at least one token after it, and the
            # suffix itself (start num_tokens - n) is not among them
            windows = sliding_window_view(tokens[:-1], n)  # [num_tokens - n, n]
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[0]) + n
                return tokens[start:start + k].tolist()
        return []
