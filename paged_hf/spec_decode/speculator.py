"""The engine's side of speculative decoding: propose drafts before a step, verify them after it.

Before `schedule()`, every decoding request may get drafts (`request.spec_token_ids`); the scheduler runs
them with the request's last token as one multi-token query (dropping them first when budget or blocks run
short). After the forward, the k + 1 logits rows of a request (its last token's and each draft's) are
sampled by the ordinary sampler, row j as if the drafts before j were the request's own output (so
penalties, min_new_tokens, bad words and logprobs see exactly what they would without speculation). The
request keeps the target tokens while each one equals the draft it checks, plus the first that does not
(or the bonus token after the last draft).

Sampled requests: the sampler draws row j by the exponential race argmax(p_j / e_j), e_j ~ Exp(1) fresh per
row, so target token j is an exact sample of p_j given the tokens before it. Keeping targets while they
match a deterministic draft d is Leviathan et al.'s rejection sampling for a one-hot draft distribution:
d is accepted with probability p(d), and on rejection the token is distributed as p without d,
renormalized (the residual max(0, p - q)). A seeded request's rng is then rewound to just after the
rows it kept, so its tokens are the same as without speculation, draft by draft.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from paged_hf.config.speculative import SpeculativeConfig
from paged_hf.core.kv_cache_manager import request_cache_key
from paged_hf.spec_decode.metrics import SpecDecodeStats
from paged_hf.spec_decode.ngram import NgramProposer
from paged_hf.spec_decode.proposer import Proposer
from paged_hf.worker.distributed import broadcast_tokens


def make_proposer(config: SpeculativeConfig, paged_config, target_info, num_blocks: int) -> Proposer:
    """The proposer of `config.method` (the draft model is loaded and given its own paged cache here)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.prompt_lookup_spec_factor)
    from paged_hf.spec_decode.draft_model import DraftModelProposer  # noqa: PLC0415 - imports the engine's runner

    return DraftModelProposer(config.model, paged_config, target_info, num_blocks, config.num_speculative_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, kv_cache_manager, proposer: Proposer):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.proposer = proposer
        kv_cache_manager.free_listeners.append(self.proposer.free)  # its per-request state goes with the blocks
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    # --- before the step ------------------------------------------------------------------------------
    def propose(self, running: list, may_speculate, max_num_batched_tokens: int) -> None:
        """Set the drafts of the running requests that decode (a request `may_speculate` rejects gets none)."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and not r.pending_forks
                    and r.grammar is None and may_speculate(r)]
        for request in running:
            request.spec_token_ids = []
        k = self.num_drafts_per_request(running, len(decoding), max_num_batched_tokens)
        if k == 0:
            return
        # the step emits one more token than it accepts drafts
        num_drafts = [min(k, r.sampling_params.max_new_tokens - len(r.output_token_ids) - 1) for r in decoding]
        for request, drafts in zip(decoding, self.proposer.propose_batch(decoding, num_drafts)):
            request.spec_token_ids = drafts

    def num_drafts_per_request(self, running: list, num_decoding: int, max_num_batched_tokens: int) -> int:
        """The policy: drafts fill what is left of `max_verify_tokens` once every running request has its
        own tokens (prefill chunks included), shared evenly; none past `disable_by_batch_size`."""
        config = self.config
        if num_decoding == 0:
            return 0
        if config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size:
            return 0
        other = sum(min(r.num_tokens_to_compute, max_num_batched_tokens) for r in running
                    if r.num_tokens_to_compute != 1)
        spare = config.max_verify_tokens - other - num_decoding
        return max(0, min(config.num_speculative_tokens, spare // num_decoding))

    # --- after the forward ----------------------------------------------------------------------------
    def verify(self, sampler, requests: list, rows: list, logits: torch.Tensor, spec_logits: torch.Tensor) -> list:
        """-> per request, the [(token_id, logprobs)] it emits this step. logits: [num_requests, vocab_size]
        (each request's last-token row); spec_logits: [num_drafts, vocab_size], the draft rows in request order."""
        all_rows, index = [], []
        offset = len(requests)
        for i, (request, row) in enumerate(zip(requests, rows)):
            drafts = request.spec_token_ids
            all_rows.append(row)
            index.append(i)
            for j in range(len(drafts)):  # row j + 1 sees drafts[: j + 1] as output
                all_rows.append(replace(row, output_token_ids=row.output_token_ids + drafts[: j + 1]))
                index.append(offset + j)
            offset += len(drafts)
        stacked = torch.cat([logits, spec_logits])[torch.tensor(index, device=logits.device)]  # [num_rows, vocab]
        rewind = {id(r): r.rng.get_state() for r in requests if _draws_seeded(r)}
        out = sampler(stacked, all_rows)
        token_ids = broadcast_tokens(out.token_ids, logits.device)
        emitted, row = [], 0
        for request in requests:
            drafts = request.spec_token_ids
            targets = token_ids[row: row + len(drafts) + 1]
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == targets[num_accepted]:
                num_accepted += 1
            emitted.append(list(zip(targets[: num_accepted + 1], out.logprobs[row: row + num_accepted + 1])))
            if drafts:
                self.stats.record(len(drafts), num_accepted)
                if id(request) in rewind and num_accepted < len(drafts):  # all kept: the sampler drew just those
                    _rewind(request.rng, rewind[id(request)], num_accepted + 1, stacked)
            row += len(drafts) + 1
        return emitted

    def commit(self, request, num_emitted: int) -> None:
        """After the request took its tokens (and did not finish): the accepted drafts' K/V is kept, the rest
        rolled back (blocks past its tokens freed); blocks now full of verified tokens join the prefix cache."""
        if not request.spec_token_ids:
            return
        request.num_computed_tokens += num_emitted - 1
        request.spec_token_ids = []
        self.kv_cache_manager.trim(request)
        self.kv_cache_manager.cache_full_blocks(request, request_cache_key(request))
        self.proposer.commit(request)


def _draws_seeded(request) -> bool:
    return bool(request.spec_token_ids) and request.rng is not None and not request.sampling_params.greedy


def _rewind(rng: torch.Generator, state: torch.Tensor, num_rows: int, like: torch.Tensor) -> None:
    """Put the rng where the sampler would have left it after `num_rows` rows (the sampler draws a
    vocab-sized row of exponentials per row, in the dtype it samples in)."""
    rng.set_state(state)
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    row = torch.empty(like.shape[-1], dtype=dtype, device=rng.device)
    for _ in range(num_rows):
        row.exponential_(generator=rng)
