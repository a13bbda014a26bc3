"""logit_bias, allowed_token_ids and bad_words as one scatter per kind: the same logits as applying each entry
in turn (the loop they replaced), and a step with a full-vocabulary logit_bias for 16 rows in milliseconds."""

from __future__ import annotations

import random
import time

import pytest
import torch

from paged_hf import SamplingParams
from paged_hf.sample.sampler import SamplingRow
from paged_hf.sample.token_constraints import LOGIT_BIAS_LIMIT, apply_token_constraints, banned_tokens

VOCAB = 300


def reference(scores: torch.Tensor, rows) -> torch.Tensor:
    """Entry by entry, in vLLM's order: allowed_token_ids, bad_words, logit_bias (clamped)."""
    scores = scores.clone()
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids:
            keep = torch.zeros(VOCAB, dtype=torch.bool)
            keep[[t for t in p.allowed_token_ids if t < VOCAB]] = True
            scores[i][~keep] = float("-inf")
        for t in banned_tokens(row.bad_words_token_ids or (), row.output_token_ids):
            if t < VOCAB:
                scores[i, t] = float("-inf")
        for t, bias in (p.logit_bias or {}).items():
            if t < VOCAB:
                scores[i, t] += max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, bias))
    return scores


def random_row(rng: random.Random) -> SamplingRow:
    fields = {}
    if rng.random() < 0.5:
        fields["logit_bias"] = {rng.randrange(VOCAB + 20): rng.uniform(-150, 150) for _ in range(rng.randrange(1, 40))}
    if rng.random() < 0.4:
        fields["allowed_token_ids"] = [rng.randrange(VOCAB + 20) for _ in range(rng.randrange(1, 30))]
    words = None
    if rng.random() < 0.5:
        words = [[rng.randrange(VOCAB + 5) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 6))]
    if words and output and rng.random() < 0.7:  # often end with a bad word's prefix
        word = rng.choice(words)
        output += word[:-1]
    return SamplingRow(SamplingParams(**fields), [1, 2], output, None, bad_words_token_ids=words)


@pytest.mark.parametrize("seed", range(20))
def test_matches_applying_each_entry_in_turn(seed):
    rng = random.Random(seed)
    rows = [random_row(rng) for _ in range(rng.randrange(1, 9))]
    scores = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
    before = scores.clone()
    got = apply_token_constraints(scores, rows)
    assert torch.equal(scores, before)  # never in place
    torch.testing.assert_close(got, reference(scores, rows), rtol=0, atol=1e-5)
    torch.testing.assert_close(apply_token_constraints(scores, rows), got)  # the cached tensors: same again


def test_a_full_vocabulary_logit_bias_costs_milliseconds():
    """Issue 33: logit_bias with all 49,152 ids and n=16 took 4.4 s per step as a Python loop."""
    vocab = 49_152
    params = SamplingParams(logit_bias={t: -1.0 for t in range(vocab)}, allowed_token_ids=list(range(vocab)))
    rows = [SamplingRow(params, [1], [], None) for _ in range(16)]  # the n children share their params
    scores = torch.zeros(16, vocab)
    apply_token_constraints(scores, rows)  # the first step makes the request's tensors
    start = time.perf_counter()
    for _ in range(5):
        out = apply_token_constraints(scores, rows)
    assert (time.perf_counter() - start) / 5 < 0.1
    assert torch.equal(out, torch.full((16, vocab), -1.0))
