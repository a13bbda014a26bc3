"""One prompt's beam search inside the engine: which sequence holds each beam, and each round's forks and frees.

A beam's tokens and KV live in an engine `Request`. Before the first round all `beam_width` rows are the
prompt's one sequence (HF starts from beam_width copies of the prompt). After a round, a sequence chosen
by several new beams keeps one and forks the others (`Scheduler.fork`: shared blocks, copy-on-write of the
last partial one); a sequence chosen by none is finished, so its blocks go back at once.
"""

from __future__ import annotations

import math
import time

import torch

from paged_hf.beam.scoring import BeamScorer, Hypothesis
from paged_hf.core.request import Request
from paged_hf.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    FinishReason,
    RequestMetrics,
    RequestOutput,
)


class BeamCohort:
    """Beam searches that stop together, like the prompts of one HF `generate` batch: HF runs every prompt
    until all are done (a done prompt's hypotheses no longer change, but its running beams go on), and its
    `output_scores` hold one entry per round of that longest run."""

    def __init__(self):
        self.groups: list[BeamGroup] = []

    def should_stop(self, group: BeamGroup) -> bool:
        rounds = [g.done_round for g in self.groups]
        return group.scorer.exhausted or (None not in rounds and group.scorer.num_generated >= max(rounds))

    @property
    def num_rounds(self) -> int:
        return max(g.done_round for g in self.groups)


class BeamGroup:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params, first: Request, stop_ids: list[int],
                 tokenizer=None, cohort: BeamCohort | None = None, record: bool = False):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stop_ids = frozenset(stop_ids)
        self.tokenizer = tokenizer
        self.scorer = BeamScorer(params.beam_width, params.max_tokens, params.length_penalty, params.early_stopping,
                                 len(self.stop_ids))
        self.rows: list[Request] = [first] * params.beam_width  # row i: the sequence that holds beam i
        self.pending: dict[Request, torch.Tensor] = {}  # this round's next-token logits, per live sequence
        self.cohort = cohort
        if cohort is not None:
            cohort.groups.append(self)
        self.done_round: int | None = None  # the round after which the hypotheses were final
        self.ended = False  # the search is over (not aborted)
        self.record = record  # keep each round's logits and log-probs (HF's output_logits / output_scores)
        self.logits_per_round: list[torch.Tensor] = []  # [beam_width, vocab_size] float32 each
        self.log_probs_per_round: list[torch.Tensor] = []
        self.arrival_time = first.arrival_time
        self.finish_time: float | None = None

    @property
    def children(self) -> list[Request]:
        """The live sequences (what `abort` finishes)."""
        return list(dict.fromkeys(self.rows))

    @property
    def finished(self) -> bool:
        return all(child.is_finished for child in self.children)

    # --- a round ----------------------------------------------------------------------------------------
    def deliver(self, request: Request, logits: torch.Tensor) -> None:
        """The logits after `request`'s last token (a float32 copy, as HF takes)."""
        self.pending[request] = logits.to(dtype=torch.float32, copy=True)

    @property
    def ready(self) -> bool:
        return all(request in self.pending for request in self.rows)

    def decide(self, scheduler) -> None:
        """Score the round, then fork, extend and free the sequences to hold the new beams (or end)."""
        logits = torch.stack([self.pending[request] for request in self.rows])  # [beam_width, vocab_size]
        self.pending = {}
        log_probs = self._log_probs(logits)
        if self.record:
            self.logits_per_round.append(logits)
            self.log_probs_per_round.append(log_probs)
        moves = self.scorer.step(log_probs, self.stop_ids)
        if self.scorer.done and self.done_round is None:
            self.done_round = self.scorer.num_generated
        if self.scorer.done if self.cohort is None else self.cohort.should_stop(self):
            for request in self.children:
                scheduler.finish(request, FinishReason.STOP)
            self.ended = True
            self.finish_time = time.monotonic()
            return
        self._move(moves, scheduler)

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """HF's beam-search scores: log_softmax in float32, then min-length masking and repetition penalty."""
        log_probs = torch.log_softmax(logits, dim=-1)  # [beam_width, vocab_size]
        vocab_size = log_probs.shape[-1]
        if self.scorer.num_generated < self.params.min_tokens and self.stop_ids:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=log_probs.device)
            mask[[t for t in self.stop_ids if t < vocab_size]] = True
            log_probs = torch.where(mask, -math.inf, log_probs)
        penalty = self.params.repetition_penalty
        if penalty != 1.0:  # HF's RepetitionPenaltyLogitsProcessor over prompt + beam tokens
            tokens = torch.tensor([self.prompt_token_ids + beam for beam, _ in self.scorer.running],
                                  device=log_probs.device)  # [beam_width, num_tokens]
            score = torch.gather(log_probs, 1, tokens)
            score = torch.where(score < 0, score * penalty, score / penalty)
            log_probs = log_probs.scatter(1, tokens, score)
        return log_probs

    def _move(self, moves: list[tuple[int, int]], scheduler) -> None:
        """New beam i = old row moves[i][0] + token moves[i][1]: extend, fork or free the sequences."""
        picks: dict[Request, list[tuple[int, int]]] = {}
        for row, (parent_row, token) in enumerate(moves):
            picks.setdefault(self.rows[parent_row], []).append((row, token))
        for request in self.children:
            if request not in picks:
                scheduler.finish(request, FinishReason.STOP)  # pruned: its blocks go back before the forks take any
        rows: list[Request | None] = [None] * len(moves)
        for parent, chosen in picks.items():
            children = [_extended(parent, token) for _, token in chosen[1:]]
            scheduler.fork(parent, children)
            parent.append_token(chosen[0][1])
            rows[chosen[0][0]] = parent
            for (row, _), child in zip(chosen[1:], children):
                rows[row] = child
        self.rows = rows

    # --- outputs ----------------------------------------------------------------------------------------
    def hypotheses(self) -> list[Hypothesis]:
        return self.scorer.best(self.params.num_return_sequences)

    def output(self) -> RequestOutput:
        """As `step()` reports it: the best hypotheses once the search ended; the running beams if aborted."""
        if self.ended:
            outputs = [CompletionOutput(i, list(h.token_ids), self._text(h.token_ids), h.finish_reason)
                       for i, h in enumerate(self.hypotheses())]
        elif self.finished:  # aborted
            outputs = [CompletionOutput(i, list(tokens), self._text(tokens), FinishReason.ABORT)
                       for i, (tokens, _) in enumerate(self.scorer.running)]
        else:
            outputs = []
        return RequestOutput(self.request_id, self.prompt_token_ids, outputs, self.finished,
                             RequestMetrics(self.arrival_time, finish_time=self.finish_time))

    def beam_output(self):
        sequences = [BeamSearchSequence(self.prompt_token_ids + h.token_ids, list(h.token_ids), h.cum_logprob, h.score,
                                        h.finish_reason, self._text(h.token_ids), list(h.beam_indices))
                     for h in self.hypotheses()]
        return BeamSearchOutput(self.request_id, self.prompt_token_ids, sequences)

    def _text(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _extended(parent: Request, token: int) -> Request:
    """A new sequence holding the parent's tokens plus `token` (no blocks yet: `Scheduler.fork` shares them)."""
    child = Request(parent.request_id, parent.index, list(parent.prompt_token_ids), parent.sampling_params,
                    parent.adapter, adapter_version=parent.adapter_version, lora=parent.lora,
                    cache_salt=parent.cache_salt, arrival_time=parent.arrival_time)
    child.output_token_ids = list(parent.output_token_ids)
    child.all_token_ids = list(parent.all_token_ids)
    child.mm_items = parent.mm_items  # the prompt's images (never changed once queued): a recompute encodes them
    child.mm_positions = parent.mm_positions  # the prompt's own positions (Qwen-VL's), never changed either
    child.append_token(token)
    return child
