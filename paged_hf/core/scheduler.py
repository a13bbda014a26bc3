"""Decides each step's work: running requests first, then waiting ones, all within one token budget.

One rule covers everything (vLLM V1): a request's `num_computed_tokens` catches up with its `num_tokens`. Decodes take
one token, prompts are chunked to what the budget leaves (a chunk never ends inside an image's bidirectional span,
`multimodal.fit_chunk`), prefix hits skip ahead, and a preempted request starts again from zero (recomputed).

Parallel sampling (`n > 1`): only child 0 is queued. It stops one token short of its prompt; then its siblings fork from
it (sharing its blocks) and join the running requests, and every child computes the last prompt token itself. A sibling
without a seat (`max_num_seqs`) at fork time is queued as a plain request (it finds the prompt's blocks cached).

Policies (request_queue.py): `fcfs` runs `schedule`'s loop; `priority` and `fair` rank running and waiting requests
together (`_schedule_ranked`). What a waiting request waits for besides seats, blocks and budget (`is_ready`, an
adapter slot, with a bounded wait) is admission.py's; short steps while a request in a hurry waits for its first
token (ranked policies only) are step_pacing.py's; the bound on a stream's token gaps is stream_pace.py's.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from paged_hf.core.admission import AdmissionGate
from paged_hf.core.kv_cache_manager import KVCacheManager, request_cache_key
from paged_hf.core.multimodal import fit_chunk
from paged_hf.core.request import Request, RequestStatus
from paged_hf.core.request_queue import RankedQueue, make_waiting_queue
from paged_hf.core.scheduler_output import ScheduledRequest, SchedulerOutput
from paged_hf.core.step_pacing import StepPacer, StepTimer
from paged_hf.core.stream_pace import StreamPace, is_prefill
from paged_hf.outputs import FinishReason


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int | None = None, policy: str = "fcfs", tenant_weights: dict | None = None,
                 is_ready: Callable[[Request], bool] | None = None, max_adapter_wait_steps: int = 64,
                 clock: Callable[[], float] = time.perf_counter, max_stream_gap_s: float | None = None,
                 micro_batches: int = 1):
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras  # distinct adapters among the running requests (so in any step); None: no limit
        self.policy = policy
        self.waiting: deque[Request] | RankedQueue = make_waiting_queue(policy, tenant_weights, max_num_seqs)
        self.gate = AdmissionGate(max_loras, is_ready, max_adapter_wait_steps)
        ranked = isinstance(self.waiting, RankedQueue)
        # clock: the steps are timed to size the pacer's capped prefill and the stream pace's; tests inject one
        self.step_timer = StepTimer(clock)
        self.pacer = StepPacer(self.waiting, max_num_batched_tokens, timer=self.step_timer) if ranked else None
        self.stream_pace = (StreamPace(max_stream_gap_s, max_num_batched_tokens, self.step_timer)
                            if max_stream_gap_s is not None else None)
        self._prefill_left = max_num_batched_tokens  # this step: the prefill tokens the stream pace leaves
        self._prefill_cut = False  # this step: the stream pace cut a prefill chunk short
        self.running: list[Request] = []
        # a pipeline keeps this many micro-batches in flight (engine/pipeline_step.py): each step schedules at most
        # its share of the unfinished requests, so the batches split them evenly
        self.micro_batches = micro_batches
        self._step_seqs = math.inf  # this step: the most requests it schedules
        self.num_preemptions = 0
        self.max_num_running = 0  # the most requests that ran at once (after any step's scheduling)
        # prefix-cache lookups in tokens (vLLM's accounting): a lookup queries all of the request's tokens.
        # Lookups of preempted requests (which mostly find their own blocks again) are counted apart, so
        # that recomputation does not inflate the hit rate of new requests.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preempted_prefix_cache_queries = 0
        self.preempted_prefix_cache_hits = 0

    def add(self, request: Request) -> None:
        """Queue a request; its `pending_forks` (siblings of an n > 1 request) come along with it."""
        if isinstance(self.waiting, RankedQueue):
            self.waiting.arrive(request, self.running)
            self.pacer.arrive(request, self.gate.num_steps)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, siblings still waiting for their fork included."""
        return sum(1 + len(r.pending_forks) for r in self.waiting) + sum(len(r.pending_forks) for r in self.running)

    def _num_seats(self) -> int:
        """Seats taken out of max_num_seqs: running requests and the siblings they will fork."""
        return sum(r.num_seats for r in self.running)

    def schedule(self) -> SchedulerOutput:
        self.gate.num_steps += 1
        self.step_timer.begin(self.running)
        pace = self.stream_pace
        self._prefill_left = self.max_num_batched_tokens if pace is None else pace.prefill_allowance(self.running)
        self._prefill_cut = False
        if self.micro_batches > 1:
            unfinished = min(len(self.running) + len(self.waiting), self.max_num_seqs)
            self._step_seqs = -(-unfinished // self.micro_batches)
        out = self._schedule_ranked() if isinstance(self.waiting, RankedQueue) else self._schedule_fcfs()
        self.step_timer.scheduled(out.num_tokens)
        if self._prefill_cut:
            pace.num_paced_steps += 1
        return out

    def _paced(self, request: Request, num_new: int, start: int | None = None) -> int:
        """`num_new` from `start` (None: the computed tokens), cut to the stream pace and out of image spans."""
        if is_prefill(request) and num_new > self._prefill_left:
            self._prefill_cut, num_new = True, self._prefill_left
        return fit_chunk(request.mm_items, request.num_computed_tokens if start is None else start, num_new)

    def _schedule_fcfs(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0 and len(out.scheduled) < self._step_seqs:
            request = self.running[index]
            num_new = self._paced(request, min(request.num_tokens_to_compute, budget))
            if num_new == 0:  # a beam waiting for its siblings' logits (beam search), or prefill paced: nothing now
                index += 1
                continue
            num_spec = min(len(request.spec_token_ids), budget - num_new)  # drafts: only what is left over
            while not self.kv_cache_manager.allocate_slots(request, num_new + num_spec):
                if num_spec:  # drafts are the first to go when blocks run short
                    num_spec = 0
                    continue
                victim = self.running.pop()  # the newest request gives its blocks back
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                del request.spec_token_ids[num_spec:]
                self._add_scheduled(out, request, num_new + num_spec, num_spec)
                budget -= num_new + num_spec
                index += 1
                continue
            break
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
            if not out.scheduled and self.waiting:
                self._unpark(out, budget)
        out.block_copies = self.kv_cache_manager.take_block_copies()
        out.state_copies = self.kv_cache_manager.take_state_copies()
        self.max_num_running = max(self.max_num_running, len(self.running))
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in order (FCFS) while budget, seats and blocks last. A request with
        siblings to fork needs seats for all of them (at most max_num_seqs, so n > max_num_seqs can run)."""
        kv_cache_manager = self.kv_cache_manager
        num_seats = self._num_seats()
        adapters = self.gate.running_adapters(self.running)
        skipped: list[Request] = []  # waiting for an adapter slot: they keep their place in the queue
        while self.waiting and budget > 0 and self._prefill_left > 0 and len(out.scheduled) < self._step_seqs:
            request = self.waiting[0]
            seats = min(request.num_seats, self.max_num_seqs)
            if num_seats + seats > self.max_num_seqs:
                break
            if not self.gate.admissible(request, adapters):
                if self.gate.blocks_queue(request):
                    break
                skipped.append(self.waiting.popleft())
                continue
            hits = ([] if request.wants_prompt_logprobs or request.pools_every_token else
                    kv_cache_manager.find_cached_prefix(request, request_cache_key(request)))
            num_cached = len(hits) * kv_cache_manager.block_size
            num_new = self._paced(request, min(request.num_tokens_to_compute - num_cached, budget), num_cached)
            if (num_new == 0 < request.num_tokens_to_compute - num_cached  # its image's span waits for a step
                    or not kv_cache_manager.allocate_slots(request, num_new, hits)):
                break
            self._count_lookup(request, num_cached)
            num_seats += request.num_seats
            self.waiting.popleft()
            self._start(request)
            if adapters is not None and request.adapter_version is not None:
                adapters.add(request.adapter_version)
            if num_new == 0:  # hits reach the fork point: fork now, every child computes from the next step
                self._fork(request)
                continue
            self._add_scheduled(out, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _schedule_ranked(self) -> SchedulerOutput:
        """Running and waiting requests take the budget in rank order, best first. Victims (of a block shortage,
        or of a waiting request that finds no seat or blocks) come from the running requests not yet scheduled
        this step, lowest-ranked first."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        queue, pacer = self.waiting, self.pacer
        self.running.sort(key=queue.rank)
        pacer.begin(self.running, queue, self.gate.num_steps)
        pending = sorted(self.running, key=pacer.order)  # not yet given tokens this step, best first
        admitting, passed = True, set()  # passed: tenants whose head found no seat (fair: others may go on)
        while budget > 0 and (pending or admitting) and len(out.scheduled) < self._step_seqs:
            head = self._next_admissible(passed) if admitting else None
            admitting = head is not None
            if pending and (head is None or pacer.order(pending[0]) <= pacer.order(head)):
                budget, short = self._schedule_running(pending.pop(0), pending, out, budget)
                admitting = admitting and not short  # blocks ran short: no admission this step (as fcfs)
            elif head is not None:
                budget, admitted = self._admit_ranked(head, pending, out, budget)
                if not admitted and queue.others_may_pass:
                    passed.add(head.tenant)
                else:
                    admitting = admitted
        pacer.end()
        if not out.scheduled and self.waiting:
            self._unpark(out, budget)
        out.block_copies = self.kv_cache_manager.take_block_copies()
        out.state_copies = self.kv_cache_manager.take_state_copies()
        self.max_num_running = max(self.max_num_running, len(self.running))
        return out

    def _next_admissible(self, passed: set) -> Request | None:
        """The best-ranked waiting request that may start now (None: none, or one past the adapter bound)."""
        adapters = self.gate.running_adapters(self.running)
        urgent = [r for r in self.waiting if r in self.pacer.urgent]  # first prefills in a hurry go first
        for request in (urgent + list(self.waiting) if urgent else self.waiting):
            if request.tenant in passed and self.waiting.others_may_pass:
                continue
            if self.gate.admissible(request, adapters):
                return request
            if self.gate.blocks_queue(request):
                return None
        return None

    def _schedule_running(self, request: Request, pending: list[Request], out: SchedulerOutput,
                          budget: int) -> tuple[int, bool]:
        """fcfs's loop body for one running request (victims: `pending`'s tail, then the request itself).
        -> (budget left, whether blocks ran short)."""
        num_new = self._paced(request, self.pacer.limit(request, min(request.num_tokens_to_compute, budget), budget))
        if num_new == 0:  # a beam waiting for its siblings' logits, or prefill held back (step_pacing, stream_pace)
            return budget, False
        num_spec = min(len(request.spec_token_ids), budget - num_new)
        short = False
        while not self.kv_cache_manager.allocate_slots(request, num_new + num_spec):
            if num_spec:
                num_spec = 0
                continue
            short = True
            victim = pending.pop() if pending else request
            self._preempt_running(victim, out)
            if victim is request:
                return budget, short
        del request.spec_token_ids[num_spec:]
        self._add_scheduled(out, request, num_new + num_spec, num_spec)
        return budget - num_new - num_spec, short

    def _admit_ranked(self, request: Request, pending: list[Request], out: SchedulerOutput,
                      budget: int) -> tuple[int, bool]:
        """Start the waiting `request`, preempting the victims the policy names while no seat or blocks are
        free. -> (budget left, whether it started; not while the step holds back its prefill)."""
        allowed = self._paced(request, self.pacer.limit(request, budget, budget))
        if allowed == 0:
            return budget, False
        seats = min(request.num_seats, self.max_num_seqs)
        while self._num_seats() + seats > self.max_num_seqs:
            if not self._preempt_for(request, pending, out):
                return budget, False
        kv_cache_manager = self.kv_cache_manager
        hits = ([] if request.wants_prompt_logprobs or request.pools_every_token else
                kv_cache_manager.find_cached_prefix(request, request_cache_key(request)))
        num_cached = len(hits) * kv_cache_manager.block_size
        num_new = self._paced(request, min(request.num_tokens_to_compute - num_cached, allowed), num_cached)
        if num_new == 0 < request.num_tokens_to_compute - num_cached:  # its image's span waits for a step
            return budget, False
        while not kv_cache_manager.allocate_slots(request, num_new, hits):
            if not self._preempt_for(request, pending, out):
                return budget, False
        self._count_lookup(request, num_cached)
        self.waiting.remove(request)
        self._start(request)
        if num_new == 0:  # hits reach the fork point
            self._fork(request)
            return budget, True
        self._add_scheduled(out, request, num_new)
        return budget - num_new, True

    def _preempt_for(self, head: Request, pending: list[Request], out: SchedulerOutput) -> bool:
        """Preempt the running request the policy gives up for `head`; False when there is none."""
        victim = self.waiting.victim(head, pending, self.running)
        if victim is None:
            return False
        pending.remove(victim)
        self._preempt_running(victim, out)
        return True

    def _preempt_running(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self._preempt(victim)
        out.preempted.append(victim)

    def _start(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.gate.forget(request)

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int, num_spec: int = 0) -> None:
        if is_prefill(request):
            self._prefill_left -= num_new
        out.scheduled.append(ScheduledRequest(request, num_new, num_spec))
        if isinstance(self.waiting, RankedQueue):
            self.waiting.charge(request, num_new)
            self.pacer.scheduled(request, num_new)

    def _count_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit_tokens
        if not self.kv_cache_manager.enable_caching:
            return
        if request.num_preemptions:
            self.preempted_prefix_cache_queries += request.num_tokens
            self.preempted_prefix_cache_hits += num_hit_tokens
        else:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _fork(self, parent: Request) -> None:
        """The parent computed all prompt tokens but the last: its pending siblings share its blocks and
        join the running requests (the newest, so preempted first). Siblings without a seat are queued at
        the front as plain requests."""
        siblings, parent.pending_forks = parent.pending_forks, []
        num_seats = max(0, self.max_num_seqs - self._num_seats())
        for child in siblings:
            child.fork_parent = None
        for child in siblings[:num_seats]:
            self.kv_cache_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        self.waiting.extendleft(reversed(siblings[num_seats:]))

    def _unpark(self, out: SchedulerOutput, budget: int) -> None:
        """Every running request is a beam waiting for its siblings (beam search) and the queue's head does
        not fit: free the blocks of other requests' waiting beams, newest first, until it does. They keep
        their logits and queue at the back (they recompute once their search moves on)."""
        head = self.waiting[0].request_id
        while not out.scheduled:
            parked = [r for r in self.running if r.num_tokens_to_compute == 0 and r.request_id != head]
            if not parked:
                return
            victim = parked[-1]
            self.running.remove(victim)
            self._preempt(victim)
            self.waiting.remove(victim)
            self.waiting.append(victim)
            out.preempted.append(victim)
            self._admit_waiting(out, budget)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """Beam search: each child holds the parent's tokens plus one of its own. A parent with blocks shares
        them (the children join the running requests, seats allowing); one without (preempted) has none to
        share, so the children queue at the front and recompute (prefix-cache hits included)."""
        parent.reserved_seats = 0
        for child in children:
            child.priority, child.tenant = parent.priority, parent.tenant
        if parent.status is RequestStatus.RUNNING:
            parent.pending_forks = list(children)
            self._fork(parent)
        else:
            self.waiting.extendleft(reversed(children))

    def _preempt(self, request: Request) -> None:
        """Give the request's blocks back; it is recomputed from zero later (siblings still waiting for
        their fork stay with it). Its full blocks stay in the prefix cache until evicted."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def advance(self, scheduled: ScheduledRequest) -> None:
        """After the forward pass: the step's tokens now have K/V; publish newly full blocks, and fork the
        waiting siblings once the parent reached its fork point."""
        request = scheduled.request
        request.num_computed_tokens += scheduled.num_new_tokens - scheduled.num_spec_tokens  # drafts: once verified
        self.kv_cache_manager.cache_full_blocks(request, request_cache_key(request))
        if request.pending_forks and request.num_computed_tokens == request.fork_point:
            self._fork(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (stop, length, abort) wherever it is, and free its blocks at once. Siblings still
        waiting for their fork end first (an abort goes through the children last to first); a parent
        never stops on its own before its fork, which comes before its first token."""
        assert not request.pending_forks, f"{request.request_id}: finish the siblings before their parent"
        if request.fork_parent is not None:
            request.fork_parent.pending_forks.remove(request)
            request.fork_parent = None
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.gate.forget(request)
        self.kv_cache_manager.free(request)
        request.mm_features.clear()  # the features kept for an image it had not finished computing
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
