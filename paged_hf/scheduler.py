"""Decides each step's work: running requests first, then waiting ones, all within one token budget.

One rule covers everything (vLLM V1): a request's `num_computed_tokens` catches up with its `num_tokens`.
Decodes take one token, prompts are chunked to what the budget leaves, prefix hits skip ahead, and a
preempted request simply starts again from zero (its tokens are recomputed, its outputs unchanged).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose K/V this step computes, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so its logits give the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 cache_key=lambda request: b""):
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_key = cache_key  # request -> bytes mixed into its block hashes (adapter identity, salt)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, "a running request with nothing to compute"
            while not self.kv_cache_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # the newest request gives its blocks back
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
                continue
            break
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = []
            if request.num_computed_tokens == 0:
                hits = self.kv_cache_manager.find_cached_prefix(request, self.cache_key(request))
            num_cached = len(hits) * self.kv_cache_manager.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            if not self.kv_cache_manager.allocate_slots(request, num_new, hits):
                break
            if self.kv_cache_manager.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def advance(self, scheduled: ScheduledRequest) -> None:
        """After the forward pass: the step's tokens now have K/V; publish newly full blocks."""
        request = scheduled.request
        request.num_computed_tokens += scheduled.num_new_tokens
        self.kv_cache_manager.cache_full_blocks(request, self.cache_key(request))

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stop, length, abort) wherever it is, and free its blocks at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
