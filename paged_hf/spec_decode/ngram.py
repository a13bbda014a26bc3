"""Prompt lookup (vLLM's `ngram` proposer): the text a request restates or edits is already in its context.

The longest suffix of the request's tokens (n tokens, prompt_lookup_min <= n <= prompt_lookup_max) that
occurred earlier in its prompt or output is found; the tokens that followed its latest occurrence are the
proposal. Why the latest: when an output repeats itself (a list, a loop) the latest occurrence is the one it
repeats, and in an edited passage it is the nearest context. How many: at most k, and at most
`spec_factor * n` (when given): a 1-token match is a weak guess, and a wrong draft costs a verify slot, so
short matches draft little and long matches draft all k (suffix decoding's rule, Oliaro et al. 2024).

No model, no state: the candidate occurrences of the last token are found in one vectorized comparison, then
narrowed one token further back at a time, so a step costs O(context) however large prompt_lookup_max is.
"""

from __future__ import annotations

import math

import numpy as np

from paged_hf.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, spec_factor: float | None = None):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.spec_factor = spec_factor

    def propose_batch(self, requests: list, num_drafts: list[int]) -> list[list[int]]:
        return [self.propose(request.all_token_ids, k) for request, k in zip(requests, num_drafts)]

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (fewer, or none, when nothing matches)."""
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # ends[i]: one past an earlier occurrence of the last n tokens; below num_tokens - 1, so at least one
        # token follows it and the suffix itself is not among them
        ends = np.flatnonzero(tokens[:-1] == tokens[-1]) + 1
        n, match = 1, None
        while ends.size:
            if n >= self.min_n:
                match = (n, int(ends[-1]))
            if n == self.max_n:
                break
            ends = ends[ends > n]  # room for one more token before the occurrence
            ends = ends[tokens[ends - n - 1] == tokens[-n - 1]]
            n += 1
        if match is None:
            return []
        n, end = match
        if self.spec_factor is not None:
            k = min(k, math.ceil(self.spec_factor * n))
        return tokens[end:end + k].tolist()
