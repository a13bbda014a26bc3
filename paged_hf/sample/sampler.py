"""Turns one step's logits into tokens, each row with its own SamplingParams, vectorized across rows.

vLLM's token constraints come first (allowed_token_ids, bad_words, logit_bias: token_constraints.py), then
the processors in HF generate's order (min_new_tokens, repetition penalty, then temperature, top-k,
top-p, min-p), so greedy decoding matches HF's `generate` token for token. Sampling uses the exponential
race (argmax of probs / q, q ~ Exp(1)) rather than `torch.multinomial`: a seeded row then draws q from
its own rng (a torch.Generator), so its tokens never depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_hf.kernels import layer_ops
from paged_hf.sample.structured_output import GrammarState, apply_grammar_masks
from paged_hf.sample.token_constraints import apply_token_constraints, has_constraints
from paged_hf.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One row of the logits matrix: the request it belongs to."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (before this step's token)
    rng: torch.Generator | None  # set for seeded requests; None = the global RNG
    grammar: GrammarState | None = None  # structured outputs: only the tokens it allows may be drawn
    bad_words_token_ids: list[list[int]] | None = None  # the request's bad_words, tokenized at submission


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: None when params.logprobs is None, else {token_id: logprob} for the sampled token and the
    # top-`logprobs` tokens, from log_softmax of the raw logits (vLLM's default).
    logprobs: list[dict[int, float] | None]


def make_rng(seed: int, index: int, device) -> torch.Generator:
    """The rng of child `index` of a request with `seed`: a stream that depends on (seed, index) only.

    SplitMix64 spreads (seed, index) over 64 bits, so children of one seed differ, any int seed works
    (negative or huge), and seeds that only differ above bit 32 still differ on CPU (whose torch.Generator
    keeps only the low 32 bits of its seed).
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    z ^= z >> 32  # fold the high half into the low 32 bits a CPU torch.Generator keeps
    rng = torch.Generator(device=device)
    rng.manual_seed(z)
    return rng


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
        and p.logprobs is None
        and len(row.output_token_ids) >= p.min_new_tokens
        and not has_constraints(row)
    )


class Sampler:
    """Applies every row's SamplingParams to its logits and picks one token per row.

    Stateless apart from the model's EOS ids: everything a row needs comes in its SamplingRow. The input
    logits are never modified in place (they may be the model's own output buffer).
    """

    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        grammar_rows = [i for i, row in enumerate(rows) if row.grammar is not None]
        if grammar_rows:  # first, as vLLM: every processor and the logprobs see the grammar's distribution
            logits = apply_grammar_masks(logits, grammar_rows, [rows[i].grammar for i in grammar_rows])
        if all(_is_plain_greedy(row) for row in rows):  # the hot path: nothing but argmax
            # the first maximal index of each row, compiled on CPU (0.2 ms for 64 bf16 rows of a 49,152-token
            # vocabulary); else max().indices, not argmax(), which has no vectorized bf16 kernel on CPU
            token_ids = layer_ops.argmax_rows(logits) if logits.device.type == "cpu" else None
            if token_ids is None:
                token_ids = logits.max(dim=-1).indices.tolist()
            return SamplerOutput(token_ids, [None] * len(rows))

        raw = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)  # [num_rows, vocab_size]
        scores = self.penalized(raw, rows)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled:
            token_ids = scores.argmax(dim=-1)  # [num_rows]
        elif len(sampled) == len(rows):
            token_ids = _sample(scores, rows)
        else:
            token_ids = scores.argmax(dim=-1)
            index = torch.tensor(sampled, device=scores.device)
            token_ids[index] = _sample(scores[index], [rows[i] for i in sampled])
        return SamplerOutput(token_ids.tolist(), _logprobs(raw, token_ids, rows))

    def penalized(self, raw: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits after min_new_tokens masking and the penalties: what greedy rows take the argmax of and
        sampled rows go on from. No NaN, and every row keeps a token above -inf."""
        scores = self._mask_min_new_tokens(apply_token_constraints(raw, rows), rows)
        scores = _apply_repetition_penalty(scores, rows)
        return _apply_presence_frequency(scores, rows)

    def _mask_min_new_tokens(self, scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Until min_new_tokens exist, no token that would stop the request may be drawn (HF's
        MinNewTokensLengthLogitsProcessor). With ignore_eos, EOS stops nothing, so only stop_token_ids.
        A row whose every token would stop it keeps them all (there is nothing else to draw)."""
        vocab_size = scores.shape[-1]
        row_index, token_index = [], []
        for i, row in enumerate(rows):
            p = row.params
            if len(row.output_token_ids) >= p.min_new_tokens:
                continue
            ids = list(p.stop_token_ids or ())
            if not p.ignore_eos:
                ids += self.eos_token_ids + list(p.eos_token_ids or ())
            ids = [t for t in ids if t < vocab_size]
            if len(set(ids)) == vocab_size:
                continue
            row_index += [i] * len(ids)
            token_index += ids
        if not token_index:
            return scores
        return scores.index_put(_indices(row_index, token_index, scores.device), scores.new_tensor(float("-inf")))


def _indices(row_index: list[int], token_index: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)


def _apply_repetition_penalty(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor, per row: every token of prompt + output is divided by the
    penalty when positive, multiplied when negative (so a penalty > 1 always makes it less likely).
    Extreme penalties saturate at the dtype's largest finite value: never +inf (NaN in the softmax), and
    never -inf (that would mask the token) except for tokens that were masked already."""
    row_index, token_index, penalties = [], [], []
    for i, row in enumerate(rows):
        penalty = row.params.repetition_penalty
        penalties.append(penalty)
        if penalty != 1.0:
            ids = row.prompt_token_ids + row.output_token_ids
            row_index += [i] * len(ids)
            token_index += ids
    if not token_index:
        return scores
    seen = torch.zeros_like(scores, dtype=torch.bool)  # [num_rows, vocab_size]
    seen[_indices(row_index, token_index, scores.device)] = True
    finfo = torch.finfo(scores.dtype)
    penalty = torch.tensor(penalties, dtype=scores.dtype, device=scores.device)[:, None]  # [num_rows, 1]
    penalty = penalty.clamp(finfo.tiny, finfo.max)  # a float64 penalty may be 0 or inf in float32
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty).clamp(-finfo.max, finfo.max)
    return torch.where(seen & scores.isfinite(), penalized, scores)


def _apply_presence_frequency(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """OpenAI/vLLM penalties over the generated tokens only: logit -= presence * [count > 0] + frequency * count."""
    row_index, token_index, presence, frequency = [], [], [], []
    for i, row in enumerate(rows):
        p = row.params
        presence.append(p.presence_penalty)
        frequency.append(p.frequency_penalty)
        if p.presence_penalty != 0 or p.frequency_penalty != 0:
            row_index += [i] * len(row.output_token_ids)
            token_index += row.output_token_ids
    if not token_index:
        return scores
    counts = torch.zeros_like(scores)  # [num_rows, vocab_size]
    ones = counts.new_ones(len(token_index))
    counts.index_put_(_indices(row_index, token_index, scores.device), ones, accumulate=True)
    presence_t = scores.new_tensor(presence)[:, None]  # [num_rows, 1]
    frequency_t = scores.new_tensor(frequency)[:, None]
    return scores - presence_t * (counts > 0) - frequency_t * counts


def _sample(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One draw per row from its warped distribution. scores: [num_rows, vocab_size], no greedy row.
    Returns [num_rows] token ids."""
    return _draw(_probabilities(scores, rows), rows)


def _apply_temperature(scores: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """scores / temperature, as HF. Where that overflows (a temperature near 1e-5 over huge scores), the
    row's maximum is subtracted first: the softmax is the same and the row keeps a finite maximum (0)."""
    temperature = scores.new_tensor(temperatures).clamp(max=torch.finfo(scores.dtype).max)[:, None]  # [num_rows, 1]
    scaled = scores / temperature
    overflow = ~scaled.amax(dim=-1).isfinite()  # [num_rows]
    if overflow.any():
        shifted = (scores - scores.amax(dim=-1, keepdim=True)) / temperature  # <= 0, its maximum 0
        scaled = torch.where(overflow[:, None], shifted, scaled)
    return scaled


def _probabilities(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (HF's warpers, in HF's order) -> [num_rows, vocab_size] probabilities
    (unnormalized after min-p). scores: from Sampler.penalized, no greedy row."""
    params = [row.params for row in rows]
    vocab_size = scores.shape[-1]
    neg_inf = float("-inf")

    if any(p.temperature != 1.0 for p in params):
        scores = _apply_temperature(scores, [p.temperature for p in params])

    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]  # 0 = off
    if any(top_ks):
        max_k = max(top_ks)
        kth = scores.topk(max_k, dim=-1).values  # [num_rows, max_k], descending
        k_index = torch.tensor([k - 1 if k else 0 for k in top_ks], device=scores.device)[:, None]
        threshold = kth.gather(1, k_index)  # [num_rows, 1]: the k-th largest score
        enabled = torch.tensor([k > 0 for k in top_ks], device=scores.device)[:, None]
        scores = scores.masked_fill(enabled & (scores < threshold), neg_inf)  # ties with the k-th stay

    if any(p.top_p < 1.0 for p in params):
        # As TopPLogitsWarper: drop the low tail whose total prob is <= 1 - top_p, keep the top token.
        sorted_scores, sorted_index = scores.sort(dim=-1)  # ascending
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, vocab_size]
        remove = cumulative <= (1 - scores.new_tensor([p.top_p for p in params]))[:, None]
        remove[:, -1] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_index, remove), neg_inf)

    probs = scores.softmax(dim=-1)  # [num_rows, vocab_size]
    if any(p.min_p > 0 for p in params):
        min_p = probs.new_tensor([p.min_p for p in params])[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)  # max is kept
    return probs


def _draw(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row from `probs` [num_rows, vocab_size]; seeded rows from their own rng."""
    # Exponential race: argmax(probs / q) with q ~ Exp(1) is a draw from probs (no need to renormalize).
    q = torch.empty_like(probs)  # [num_rows, vocab_size]
    seeded = [i for i, row in enumerate(rows) if row.rng is not None]
    if not seeded:
        q.exponential_()
    else:
        unseeded = [i for i, row in enumerate(rows) if row.rng is None]
        if unseeded:
            q[torch.tensor(unseeded, device=q.device)] = torch.empty_like(q[: len(unseeded)]).exponential_()
        for i in seeded:  # each seeded row from its own stream only: same tokens whatever the batch
            q[i].exponential_(generator=rows[i].rng)  # a contiguous row: the same draws as a fresh tensor
    q.clamp_min_(torch.finfo(q.dtype).tiny)  # never 0 / 0
    return (probs / q).argmax(dim=-1)


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]) -> list[dict[int, float] | None]:
    """{token: logprob} for the sampled token and the top-`logprobs` tokens of the raw distribution."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[dict[int, float] | None] = [None] * len(rows)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=raw.device)
    logprobs = raw[index].log_softmax(dim=-1)  # [num_wanted, vocab_size]
    chosen = token_ids[index]  # [num_wanted]
    chosen_logprobs = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    max_k = min(max(rows[i].params.logprobs for i in wanted), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (logprobs[:, :0], chosen[:, None][:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, (i, token) in enumerate(zip(wanted, chosen.tolist())):
        k = rows[i].params.logprobs
        entry = {token: chosen_logprobs[j]}
        entry.update(zip(top_ids[j][:k], top_values[j][:k]))
        result[i] = entry
    return result
