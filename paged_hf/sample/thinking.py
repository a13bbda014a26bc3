"""A thinking model's output constrained as vLLM constrains it: free while the model thinks, the request's grammar
from the token after the marker that ends the thinking (`SamplingParams.thinking_end_token_ids`), and past
`thinking_token_budget` tokens of thinking the marker itself, token by token. Where the thinking is optional
(`thinking_start_token_id`), the first token is the grammar's or the thinking's start.

`ThinkingGate` is one sequence's state. It stands where a `GrammarState` stands (the sampler masks its row,
the request advances it with each token, the stop check asks whether it is done), around the sequence's grammar
or none (a budget alone).
"""

from __future__ import annotations

import numpy as np

from paged_hf.sample.structured_output import GrammarState


class ThinkingGate:
    """One sequence: thinking until `end_ids` have been generated, then the answer under `grammar` (if any).

    `start_id`: the thinking is optional (Magistral's `[THINK]`): the first token decides. It may be the start
    marker (then the model thinks) or anything the grammar allows (then the answer starts there)."""

    def __init__(self, end_ids: list[int], budget: int | None, grammar: GrammarState | None, vocab_size: int,
                 start_id: int | None = None):
        self.end_ids = tuple(end_ids)
        self.budget = budget
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.start_id = start_id
        self.tokens: list[int] = []  # every token accepted, the thinking's and the answer's
        self.answer_from: int | None = None  # where the answer starts in `tokens`, once the marker is out
        self.own_rejected: int | None = None

    @property
    def thinking(self) -> bool:
        return self.answer_from is None

    @property
    def undecided(self) -> bool:
        """Before the first token of an optional thinking."""
        return self.start_id is not None and not self.tokens

    @property
    def num_thinking_tokens(self) -> int:
        """The thinking's tokens, its end marker included."""
        return len(self.tokens) if self.thinking else self.answer_from

    def accept(self, token_id: int) -> bool:
        """Advance over a generated token; False (and no move) where the budget's marker or the grammar forbids it."""
        if self.undecided and token_id != self.start_id:  # no thinking: this token is the answer's first
            if self.grammar is not None and not self.grammar.accept(token_id):
                return False
            self.tokens.append(token_id)
            self.answer_from = 0
            return True
        if self.thinking:
            forced = self.forced_token()
            if forced is not None and token_id != forced:
                self.own_rejected = token_id
                return False
            self.tokens.append(token_id)
            if tuple(self.tokens[-len(self.end_ids):]) == self.end_ids:
                self.answer_from = len(self.tokens)
            return True
        if self.grammar is not None and not self.grammar.accept(token_id):
            return False
        self.tokens.append(token_id)
        return True

    def forced_token(self) -> int | None:
        """Past the budget, the marker's next token (after the part of it the model already wrote); else None."""
        if self.budget is None or not self.thinking or len(self.tokens) < self.budget:
            return None
        written = next((size for size in range(len(self.end_ids) - 1, 0, -1)
                        if tuple(self.tokens[-size:]) == self.end_ids[:size]), 0)
        return self.end_ids[written]

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (the grammar's share of them too)."""
        if not num_tokens:
            return
        keep = len(self.tokens) - num_tokens
        if self.answer_from is not None:
            if self.grammar is not None:
                self.grammar.rollback(len(self.tokens) - max(keep, self.answer_from))
            if keep < self.answer_from or keep == 0:
                self.answer_from = None
        del self.tokens[keep:]

    @property
    def rejected_token(self) -> int | None:
        if self.own_rejected is not None or self.grammar is None:
            return self.own_rejected
        return self.grammar.rejected_token

    @property
    def is_terminated(self) -> bool:
        """The answer's grammar is complete (never while thinking, nor without a grammar)."""
        return not self.thinking and self.grammar is not None and self.grammar.is_terminated

    def fill(self, bitmask: np.ndarray, index: int) -> None:
        """Row `index` of the allowed-token bitmask: all while thinking (it starts all set), the marker's next
        token past the budget, the grammar's choice in the answer."""
        forced = self.forced_token()
        if forced is not None:
            bitmask[index] = 0
            bitmask[index].view(np.uint32)[forced // 32] |= np.uint32(1 << (forced % 32))
        elif self.undecided and self.grammar is not None:  # the grammar's first tokens, or the thinking's start
            self.grammar.fill(bitmask, index)
            bitmask[index].view(np.uint32)[self.start_id // 32] |= np.uint32(1 << (self.start_id % 32))
        elif not self.thinking and self.grammar is not None:
            self.grammar.fill(bitmask, index)
