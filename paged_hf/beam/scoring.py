"""HF's beam-search arithmetic for one prompt, kept apart from the engine's sequences and blocks.

`BeamScorer.step` is transformers' `_beam_search` loop body (`_get_top_k_continuations`,
`_get_running_beams_for_next_iteration`, `_update_finished_beams`, `_check_early_stop_heuristic`) for a batch
of one, with the same float32 tensors, the same -1e9 sentinels and the same `torch.topk` calls, so its
hypotheses and scores equal HF's bit for bit when the log-probs do. What it does not know is where a beam's
tokens and KV live: it answers each round with (parent row, token) pairs, and the engine forks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_hf.outputs import FinishReason

NEG = -1.0e9  # HF's "impossible" score: large but finite, so topk still orders what it pads


@dataclass
class Hypothesis:
    """One finished beam (HF: a row of `sequences` with its `beam_scores` entry)."""

    token_ids: list[int]  # generated tokens (an EOS that ended it included)
    beam_indices: list[int]  # per generated token, the row of the beam it extended (HF's beam_indices)
    cum_logprob: float  # sum of the (processed) log-probs of its tokens
    score: float  # cum_logprob / len(token_ids) ** length_penalty: HF's sequences_scores
    finish_reason: FinishReason  # STOP (a stop token) or LENGTH


class BeamScorer:
    """Running beams, finished hypotheses and the early-stop state of one prompt's beam search."""

    def __init__(self, num_beams: int, max_tokens: int, length_penalty: float, early_stopping: bool | str,
                 num_stop_ids: int):
        self.num_beams = num_beams
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + num_stop_ids) * num_beams  # HF's beams_to_keep
        self.top_mask = torch.arange(self.num_candidates)[None] < num_beams  # [1, candidates]
        # every row starts as the prompt; only row 0 may be extended in the first round (HF's -1e9 trick)
        self.running_scores = torch.zeros((1, num_beams), dtype=torch.float)  # [1, num_beams]
        self.running_scores[:, 1:] = NEG
        self.running: list[tuple[list[int], list[int]]] = [([], []) for _ in range(num_beams)]  # (tokens, beam indices)
        self.finished_scores = torch.full((1, num_beams), NEG, dtype=torch.float)  # [1, num_beams], best first
        self.finished: list[Hypothesis | None] = [None] * num_beams  # None: an empty slot
        self.is_finished = torch.zeros((1, num_beams), dtype=torch.bool)
        self.improvable = torch.ones((1, 1), dtype=torch.bool)  # HF's is_early_stop_heuristic_unsatisfied
        self.num_generated = 0
        self.done = False  # nothing can change the hypotheses any more
        self.exhausted = False  # every candidate hit a stop (max_tokens reached): no round can follow

    def step(self, log_probs: torch.Tensor, stop_ids: frozenset[int]) -> list[tuple[int, int]]:
        """One round. log_probs: [num_beams, vocab_size] float32, processed, row i extends running beam i.
        Returns the new running beams as (parent row, token), best first."""
        vocab_size = log_probs.shape[-1]
        accumulated = (log_probs[None] + self.running_scores[:, :, None]).reshape(1, -1)  # [1, beams * vocab]
        top_log_probs, top_index = torch.topk(accumulated, k=self.num_candidates)  # [1, candidates]
        parents, tokens = (top_index // vocab_size)[0].tolist(), (top_index % vocab_size)[0].tolist()
        last = self.num_generated + 1 >= self.max_tokens
        hits = torch.tensor([[last or token in stop_ids for token in tokens]])  # [1, candidates]
        candidates = [(self.running[p][0] + [t], self.running[p][1] + [p]) for p, t in zip(parents, tokens)]

        running_log_probs = top_log_probs + hits.to(torch.float32) * NEG
        next_index = torch.topk(running_log_probs, k=self.num_beams)[1]  # [1, num_beams]
        self.running_scores = running_log_probs.gather(1, next_index)
        chosen = next_index[0].tolist()
        self.running = [candidates[j] for j in chosen]

        self._update_finished(top_log_probs, hits, candidates, tokens, stop_ids)
        self.num_generated += 1
        self._update_done(hits)
        return [(parents[j], tokens[j]) for j in chosen]

    def _update_finished(self, top_log_probs, hits, candidates, tokens, stop_ids) -> None:
        """Merge the candidates that just finished among the top num_beams into the best-num_beams list."""
        just_finished = hits & self.top_mask
        scores = top_log_probs / ((self.num_generated + 1) ** self.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        scores += full.to(torch.float32) * NEG
        scores += (~self.improvable).to(torch.float32) * NEG
        scores += (~just_finished) * NEG
        merged_scores = torch.cat((self.finished_scores, scores), dim=1)
        merged_finished = torch.cat((self.is_finished, just_finished), dim=1)
        keep = torch.topk(merged_scores, k=self.num_beams)[1]  # [1, num_beams]
        self.finished_scores = merged_scores.gather(1, keep)
        self.is_finished = merged_finished.gather(1, keep)
        cum = top_log_probs[0].tolist()
        finished = []
        for m, score in zip(keep[0].tolist(), self.finished_scores[0].tolist()):
            if m < self.num_beams:
                finished.append(self.finished[m])
                continue
            j = m - self.num_beams
            token_ids, beam_indices = candidates[j]
            reason = FinishReason.STOP if tokens[j] in stop_ids else FinishReason.LENGTH
            finished.append(Hypothesis(token_ids, beam_indices, cum[j], score, reason))
        self.finished = finished

    def _update_done(self, hits: torch.Tensor) -> None:
        """HF's stopping rule for this prompt: no running beam can beat the worst kept hypothesis (per
        early_stopping's heuristic), or (early_stopping=True) num_beams hypotheses are kept, or every candidate
        hit a stop. Past that point HF's later rounds cannot change this prompt's hypotheses."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        best_running = self.running_scores[:, :1] / (best_length**self.length_penalty)
        worst_finished = torch.where(self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], NEG)
        self.improvable = self.improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        self.exhausted = bool(torch.all(hits))
        all_full = bool(torch.all(self.is_finished)) and self.early_stopping is True
        self.done = self.done or not bool(self.improvable) or all_full or self.exhausted

    def best(self, count: int) -> list[Hypothesis]:
        """The `count` best hypotheses (HF's sequences[:num_return_sequences]), best first."""
        return [h for h in self.finished[:count] if h is not None]
