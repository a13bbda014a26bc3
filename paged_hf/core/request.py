"""The state of one sequence inside the engine: its tokens, how many have K/V in the cache, its blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from paged_hf.core.multimodal import MultiModalItem, MultiModalPositions
from paged_hf.outputs import FinishReason
from paged_hf.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_hf.integrations.peft import LoRAAdapter


class SequenceGrammar(Protocol):
    """What is called on a sequence's structured-output state (sample.structured_output's GrammarState; a
    protocol because that layer sits above core)."""

    rejected_token: int | None  # a generated token the grammar forbids (the stop check fails the request)

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_terminated(self) -> bool: ...


class SequenceDetokenizer(Protocol):
    """What is called on a sequence's detokenizer (engine.detokenizer's IncrementalDetokenizer; a protocol
    because the engine sits above core)."""

    token_ids: list[int]  # the tokens read so far
    stop_string: str | None  # the stop string that was hit

    def update(self, new_token_ids: list[int]) -> bool: ...

    def visible_text(self, finished: bool) -> str: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence. A user request with `n > 1` becomes n of these (children), sharing `request_id`.

    The single scheduling rule: `num_computed_tokens` catches up with `num_tokens` within the token budget.
    A prefill chunk, a decode step, a prefix-cache hit and a resume after preemption are all that rule.

    Parallel sampling: child 0 is the only one queued; the others wait in its `pending_forks` (their
    `fork_parent` points back) until it has computed every prompt token but the last. Then they fork: they
    share its blocks (ref counts) and each computes the last prompt token itself, so each gets its own
    logits. From then on every child is an ordinary request.
    """

    request_id: str
    index: int  # child index within its user request (0 when n == 1)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    adapter: str | None = None
    adapter_version: int | None = None  # which load of `adapter` (a re-load under the same name is a new one)
    lora: LoRAAdapter | None = field(default=None, repr=False)  # the adapter's weights
    cache_salt: str | None = None  # mixed into the block hashes: cached blocks are shared only with equal salts
    priority: int = 0  # scheduling_policy "priority": lower first (vLLM's meaning); ties in arrival order
    tenant: str | None = None  # scheduling_policy "fair": who shares the budget (the user, API key or adapter)
    rng: torch.Generator | None = None  # a seeded request's own random stream (sample.sampler.make_rng)
    grammar: SequenceGrammar | None = field(default=None, repr=False)  # structured outputs: own per child
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] | None = None
    detokenizer: SequenceDetokenizer | None = field(default=None, repr=False)  # with a tokenizer
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS, length)
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)  # sampling_params.bad_words, tokenized
    # {position: {token_id: logprob}} of prompt tokens 1.. (child 0 only; filled while its prompt is computed)
    prompt_logprobs: dict[int, dict[int, float]] | None = field(default=None, repr=False)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts of this step, not yet verified (spec_decode)
    block_ids: list[int] = field(default_factory=list)  # the block table
    state_slot: int | None = None  # a hybrid model's recurrent-state slot while it holds blocks (core/state_slots.py)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks of all_token_ids
    block_hashes_key: bytes | None = None  # the extra keys `block_hashes` were computed with
    num_cached_tokens: int | None = None  # prompt tokens hit in the prefix cache at the first scheduling
    num_cached_blocks: int = 0  # how many leading blocks of `block_ids` were offered to the prefix cache
    pending_forks: list["Request"] = field(default_factory=list, repr=False)  # siblings that fork from this one
    fork_parent: "Request | None" = field(default=None, repr=False)  # set while waiting in a parent's pending_forks
    reserved_seats: int = 0  # a beam search's first sequence: seats for the beams it will fork
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    in_flight: bool = False  # a pipeline's micro-batch computes its next token (engine/pipeline_step.py)
    # an embedding request (engine/embedding.py): its pooling, "mean" | "cls" | "lasttoken" | "max"; it computes
    # its prompt only (no sampling, no blocks beyond the prompt) and is pooled after its last prompt token
    pooling: str | None = None
    # images of the prompt (core/multimodal.py): their placeholder spans and content hashes, shared by the children
    mm_items: list[MultiModalItem] = field(default_factory=list, repr=False)
    # their embeddings once the vision tower ran ({item index: features}, opaque here): kept until the prompt's last
    # placeholder is computed, then dropped (a preempted request recomputes them if it needs them again)
    mm_features: dict = field(default_factory=dict, repr=False)
    # the prompt's own positions where its family's model does not count tokens (Qwen-VL's 3-D rotary positions),
    # shared by the children; None: a token's position is its index
    mm_positions: MultiModalPositions | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.output_logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_seats(self) -> int:
        """Seats of max_num_seqs it takes while running: itself and the sequences that will fork from it."""
        return 1 + len(self.pending_forks) + self.reserved_seats

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still missing some prompt logprobs: such a request computes its whole prompt (no prefix-cache read)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def pools_every_token(self) -> bool:
        """Mean/max/cls pooling reads the hidden states of prompt tokens from the start: such a request computes
        its whole prompt (no prefix-cache read; its computed blocks are still cached for others)."""
        return self.pooling is not None and self.pooling != "lasttoken"

    @property
    def fork_point(self) -> int:
        """Tokens computed before the pending siblings fork: all but the last prompt token."""
        return self.num_prompt_tokens - 1

    @property
    def num_tokens_to_compute(self) -> int:
        """What the scheduler may compute next: up to the fork point while siblings wait, else everything."""
        target = self.fork_point if self.pending_forks else self.num_tokens
        return target - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """The grammar advances with the tokens (a token it forbids fails the request in the stop check)."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
