"""Draft-model proposer (vLLM's `draft_model`): a smaller causal LM with the target's vocabulary proposes k
tokens greedily, in batched decode steps over every drafting request.

It runs on the engine's own parts, not a second engine: a `ModelRunner` (its own `PagedCache`), a `BlockPool`
and a `KVCacheManager` of its own, and per target request a shadow `Request` that holds the target's verified
tokens. Each step the shadows first catch up on the tokens they have not seen (the prompt at first, then the
tokens accepted since), all in one packed step that also gives each its first draft; k - 1 one-token steps
over all drafting requests give the rest. A shadow follows its request: freed when the request's blocks go
back (finished, aborted, preempted: `KVCacheManager.free_listeners`), rolled back to the verified tokens after
verification (blocks past them freed), and only its blocks of verified tokens are hashed into the draft's
prefix cache, so a resumed request or a forked sibling finds its draft's prefix again.

Drafts are the argmax of the draft's logits, so each is deterministic given the tokens: the verifier's
one-hot rejection sampling stays exact and outputs keep the model's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_hf.core.block_pool import BlockPool
from paged_hf.core.kv_cache_manager import KVCacheManager, request_cache_key
from paged_hf.core.request import Request
from paged_hf.core.scheduler_output import ScheduledRequest, SchedulerOutput
from paged_hf.spec_decode.proposer import Proposer
from paged_hf.utils import cdiv
from paged_hf.worker.distributed import broadcast_tokens
from paged_hf.worker.model_info import inspect_model
from paged_hf.worker.model_runner import ModelRunner


@dataclass(eq=False)
class DraftSequence:
    request: Request  # the shadow: the target's tokens, followed (while proposing) by its own drafts
    num_verified: int  # its first num_verified tokens are the target's


class DraftModelProposer(Proposer):
    serves_adapters = False

    def __init__(self, model, paged_config, target_info, num_target_blocks: int, num_speculative_tokens: int):
        """`num_target_blocks`: the target's pool; the draft's holds as many blocks plus room for each running
        request's drafts (a shadow holds the same tokens as its request, and up to k - 1 drafts more)."""
        model = load_draft_model(model, target_info)
        self.info = inspect_model(model)
        if self.info.vocab_size != target_info.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.info.vocab_size} tokens) differs from the "
                             f"model's ({target_info.vocab_size}): a draft model needs the same tokenizer")
        block_size = paged_config.block_size
        num_blocks = num_target_blocks + paged_config.max_num_seqs * cdiv(num_speculative_tokens, block_size)
        self.runner = ModelRunner(model, self.info, num_blocks, paged_config)
        self.block_pool = BlockPool(num_blocks, paged_config.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(self.block_pool, block_size)
        self.max_num_batched_tokens = paged_config.max_num_batched_tokens
        self.max_positions = self.info.max_positions
        self.sequences: dict[Request, DraftSequence] = {}  # target request -> its shadow
        self.num_forward_steps = 0  # forwards of the draft model (catch-up and decode steps)
        self.prefix_cache_hits = 0  # tokens of shadows found in the draft's prefix cache

    # --- the Proposer interface -----------------------------------------------------------------------
    def propose_batch(self, requests: list, num_drafts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        wanted = []
        for i, (request, k) in enumerate(zip(requests, num_drafts)):
            if self.max_positions is not None:  # the draft computes positions up to num_tokens + k - 2
                k = min(k, self.max_positions - request.num_tokens + 1)
            if k > 0:
                wanted.append((i, request, k))
        if wanted:
            self._decode(self._catch_up(wanted, drafts), drafts)
        return drafts

    def commit(self, request: Request) -> None:
        sequence = self.sequences.get(request)
        if sequence is not None:
            self._sync(request, sequence)

    def free(self, request: Request) -> None:
        sequence = self.sequences.pop(request, None)
        if sequence is not None:
            self.kv_cache_manager.free(sequence.request)

    # --- one proposal ---------------------------------------------------------------------------------
    def _catch_up(self, wanted: list, drafts: list) -> list:
        """One packed step of every shadow's unseen tokens (within the token budget, prefix hits first);
        -> the (index, sequence, k) of those that reached their last token: they have their first draft."""
        manager = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        scheduled, entries = [], []
        for i, request, k in wanted:
            if budget == 0:
                break
            sequence = self._sequence(request)
            shadow = sequence.request
            hits = [] if shadow.block_ids else manager.find_cached_prefix(shadow, request_cache_key(shadow))
            num_new = min(shadow.num_tokens - shadow.num_computed_tokens - len(hits) * manager.block_size, budget)
            if not manager.allocate_slots(shadow, num_new, hits):
                self.free(request)  # the draft's pool is short: no drafts this step, nothing else changes
                continue
            self.prefix_cache_hits += len(hits) * manager.block_size
            scheduled.append(ScheduledRequest(shadow, num_new))
            entries.append((i, sequence, k))
            budget -= num_new
        if not scheduled:
            return []
        tokens = self._run(scheduled)
        ready = []
        for entry, item in zip(entries, scheduled):
            shadow = item.request
            shadow.num_computed_tokens += item.num_new_tokens
            manager.cache_full_blocks(shadow, request_cache_key(shadow))  # its tokens are all verified here
            if id(shadow) in tokens:
                drafts[entry[0]].append(tokens[id(shadow)])
                ready.append(entry)
        return ready

    def _decode(self, active: list, drafts: list) -> None:
        """One-token steps of every shadow that wants more drafts, each fed its own last draft."""
        manager = self.kv_cache_manager
        while True:
            scheduled, kept = [], []
            for i, sequence, k in active:
                if len(drafts[i]) >= k:
                    continue
                shadow = sequence.request
                shadow.all_token_ids.append(drafts[i][-1])
                if not manager.allocate_slots(shadow, 1):
                    shadow.all_token_ids.pop()  # the pool is short: this request keeps the drafts it has
                    continue
                scheduled.append(ScheduledRequest(shadow, 1))
                kept.append((i, sequence, k))
            if not scheduled:
                return
            tokens = self._run(scheduled)
            for (i, _, _), item in zip(kept, scheduled):
                item.request.num_computed_tokens += 1
                drafts[i].append(tokens[id(item.request)])
            active = kept

    def _run(self, scheduled: list[ScheduledRequest]) -> dict[int, int]:
        """One forward of the draft model -> {id(shadow): its greedy next token} for shadows at their end."""
        out = SchedulerOutput(scheduled, block_copies=self.kv_cache_manager.take_block_copies())
        logits, inputs = self.runner.run(out)  # [num_sampled, vocab_size]
        self.num_forward_steps += 1
        # max().indices: the first maximal index, like argmax, with a vectorized bf16 kernel on CPU
        tokens = broadcast_tokens(logits.max(dim=-1).indices.tolist(), logits.device)  # tensor parallel: rank 0's
        return {id(item.request): token for item, token in zip(inputs.sampled, tokens)}

    # --- shadows --------------------------------------------------------------------------------------
    def _sequence(self, request: Request) -> DraftSequence:
        sequence = self.sequences.get(request)
        if sequence is None:
            shadow = Request(request.request_id, request.index, list(request.all_token_ids), request.sampling_params,
                             cache_salt=request.cache_salt)
            sequence = self.sequences[request] = DraftSequence(shadow, shadow.num_tokens)
        elif sequence.num_verified != request.num_tokens or sequence.request.num_tokens != request.num_tokens:
            self._sync(request, sequence)  # behind: a step without drafts, or drafts the scheduler dropped
        return sequence

    def _sync(self, request: Request, sequence: DraftSequence) -> None:
        """Make the shadow's tokens the request's: its drafts are kept as far as the request accepted them
        (their K/V is valid), the rest dropped, blocks past the tokens freed, full verified blocks hashed."""
        shadow, tokens = sequence.request, request.all_token_ids
        common = sequence.num_verified
        limit = min(shadow.num_tokens, len(tokens))
        while common < limit and shadow.all_token_ids[common] == tokens[common]:
            common += 1
        del shadow.all_token_ids[common:]
        shadow.all_token_ids.extend(tokens[common:])
        sequence.num_verified = len(tokens)
        # its last token is always computed again (as a prefix hit never covers it): its logits give the
        # first draft, also when every token was a computed draft (the request took exactly those)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, len(tokens) - 1)
        self.kv_cache_manager.trim(shadow)
        self.kv_cache_manager.cache_full_blocks(shadow, request_cache_key(shadow))


def load_draft_model(model, target_info) -> torch.nn.Module:
    """A live HF model as it is; a folder or hub id loaded in the target's dtype onto its input device."""
    if isinstance(model, torch.nn.Module):
        return model
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from paged_hf.loader.default_model import ensure_default_checkpoint, is_default_model  # noqa: PLC0415

    source = ensure_default_checkpoint() if is_default_model(model) else model
    try:
        draft = AutoModelForCausalLM.from_pretrained(source, dtype=target_info.dtype)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative draft model {str(model)!r} could not be loaded: {exc}") from None
    return draft.to(target_info.input_device).eval()
