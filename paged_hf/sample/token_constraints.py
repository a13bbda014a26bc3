"""Per-request token constraints on the logits: `allowed_token_ids`, `bad_words`, `logit_bias` (vLLM's meanings).

They run first in the sampler, before the penalties and warpers (as vLLM applies them), and never change the
logprobs a request reports (those come from the raw logits). `bad_words` are token sequences, made from the
words once at submission (`bad_words_token_ids`), because the sampler has no tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: vLLM clamps logit_bias values to this range (as OpenAI does).
LOGIT_BIAS_LIMIT = 100.0


def has_constraints(row) -> bool:
    p = row.params
    return bool(p.logit_bias or p.allowed_token_ids or row.bad_words_token_ids)


def apply_token_constraints(scores: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """scores: [num_rows, vocab_size]; a new tensor where any row has a constraint, else `scores` itself."""
    if not any(has_constraints(row) for row in rows):
        return scores
    scores = scores.clone()
    vocab_size = scores.shape[-1]
    neg_inf = float("-inf")
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids:
            allowed = torch.tensor([t for t in p.allowed_token_ids if t < vocab_size], dtype=torch.long,
                                   device=scores.device)
            keep = torch.zeros(vocab_size, dtype=torch.bool, device=scores.device)
            keep[allowed] = True
            scores[i].masked_fill_(~keep, neg_inf)
        banned = banned_tokens(row.bad_words_token_ids or (), row.output_token_ids)
        if banned:
            scores[i, [t for t in banned if t < vocab_size]] = neg_inf
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < vocab_size:
                scores[i, token_id] += max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
    return scores


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
