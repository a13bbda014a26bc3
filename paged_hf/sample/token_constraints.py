"""Per-request token constraints on the logits: `allowed_token_ids`, `bad_words`, `logit_bias` (vLLM's meanings).

They run first in the sampler, before the penalties and warpers (as vLLM applies them), and never change the
logprobs a request reports (those come from the raw logits). `bad_words` are token sequences, made from the
words once at submission (`bad_words_token_ids`), because the sampler has no tokenizer.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

#: vLLM clamps logit_bias values to this range (as OpenAI does).
LOGIT_BIAS_LIMIT = 100.0


def has_constraints(row) -> bool:
    p = row.params
    return bool(p.logit_bias or p.allowed_token_ids or row.bad_words_token_ids)


def apply_token_constraints(scores: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """scores: [num_rows, vocab_size]; a new tensor where any row has a constraint, else `scores` itself.

    One tensor op per kind and request row, from tensors made once per request (`RowConstraints`): a Python
    loop over a request's entries at every step cost 4.4 s per step for a logit_bias of all 49,152 ids with
    n=16. Only a multi-token bad word is checked in Python, and only when the output so far ends with the
    token before its last (at most max_bad_words words, a PagedConfig field).
    """
    constrained = [(i, row_constraints(row, scores.shape[-1], scores.device)) for i, row in enumerate(rows)
                   if has_constraints(row)]
    if not constrained:
        return scores
    scores = scores.clone()
    for i, c in constrained:
        row = scores[i]  # a view: the ops below write into `scores`
        if c.forbidden is not None:
            row.masked_fill_(c.forbidden, float("-inf"))
        banned = c.banned(rows[i].output_token_ids)
        if banned.numel():
            row.index_fill_(0, banned, float("-inf"))
        if c.bias_ids is not None:
            row.index_add_(0, c.bias_ids, c.bias_values.to(row.dtype))
    return scores


class RowConstraints:
    """A request's constraints as index tensors on the logits' device, made at its first step and shared by
    its n sequences (they share the params); dropped with the params."""

    def __init__(self, params, bad_words: Sequence[Sequence[int]] | None, vocab_size: int, device: torch.device):
        def ids(values) -> torch.Tensor:
            return torch.tensor([t for t in values if t < vocab_size], dtype=torch.long, device=device)

        self.forbidden = None  # allowed_token_ids as a mask of the others
        if params.allowed_token_ids:
            self.forbidden = torch.ones(vocab_size, dtype=torch.bool, device=device)
            self.forbidden[ids(params.allowed_token_ids)] = False
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            pairs = [(t, b) for t, b in params.logit_bias.items() if t < vocab_size]
            self.bias_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
            self.bias_values = torch.tensor([float(b) for _, b in pairs], device=device).clamp_(
                -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        words = [list(word) for word in bad_words or () if word[-1] < vocab_size]
        self.always = ids(word[-1] for word in words if len(word) == 1)  # one-token words: banned at every step
        self.by_previous: dict[int, list[list[int]]] = {}  # the other words by the token before their last
        for word in words:
            if len(word) > 1:
                self.by_previous.setdefault(word[-2], []).append(word)
        self.device = device

    def banned(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        candidates = self.by_previous.get(output_token_ids[-1]) if output_token_ids and self.by_previous else None
        if not candidates:
            return self.always
        extra = banned_tokens(candidates, output_token_ids)
        if not extra:
            return self.always
        return torch.cat([self.always, torch.tensor(sorted(extra), dtype=torch.long, device=self.device)])


_ROW_CONSTRAINTS: dict[tuple[int, int, str], RowConstraints] = {}  # (id(params), id(bad words), device) -> tensors


def row_constraints(row, vocab_size: int, device: torch.device) -> RowConstraints:
    """The row's `RowConstraints`, cached per params object (engine thread only)."""
    params = row.params
    key = (id(params), id(row.bad_words_token_ids), str(device))
    found = _ROW_CONSTRAINTS.get(key)
    if found is None:
        found = _ROW_CONSTRAINTS[key] = RowConstraints(params, row.bad_words_token_ids, vocab_size, device)
        weakref.finalize(params, _ROW_CONSTRAINTS.pop, key, None)
    return found


def banned_tokens(bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> set[int]:
    """The last token of every bad word whose other tokens end the output so far (a one-token word: always)."""
    banned = set()
    for word in bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or list(output_token_ids[len(output_token_ids) - len(prefix):]) == prefix:
            banned.add(word[-1])
    return banned


def bad_words_token_ids(bad_words: Sequence[str] | None, tokenizer) -> list[list[int]] | None:
    """Each word as it tokenizes alone and after a space (as vLLM does: `" word"` is often one other token)."""
    if not bad_words:
        return None
    if tokenizer is None:
        raise ValueError(f"bad_words {list(bad_words)!r} need a tokenizer: pass tokenizer= to wrap()")
    sequences = []
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
