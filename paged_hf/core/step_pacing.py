"""Short steps while a request in a hurry waits for its first token (`priority` and `fair` only; fcfs never
comes here).

A request that arrives while a step runs waits for that step, then for its own. Under a flood of long prompts both
are full of the flood's prefill chunks (the whole token budget), so the newcomer's first token costs two long
steps. Two rules make both steps short, at no cost to the running requests' decodes:

- Un-topped step: a step that carries the first prefill (the chunks before its first token) of a request whose
  class is in a hurry (`priority`: it outranks a running request; `fair`: its tenant holds fewer seats than its
  share and has been served no more than a running tenant) gives no prefill chunk to the requests that class may
  hold back (lower priorities; other tenants served as much or more), and starts none of them. Their decodes
  stay in: such first prefills go first in the step, but leave the budget's room for the decodes.
- Capped prefill: while a class in a hurry had an arrival in the last `window_steps` steps (another one may come
  any moment), the prefill chunks of the requests it may hold back share `max_num_batched_tokens // 4` tokens a
  step, so the step in flight when the next one comes is short too.
- Whatever the ranks' order, a prefill chunk leaves the budget's room for the running requests' decodes.

All of it only holds back, never preempts, so nothing starves that did not before: fair's `holds_back` lets a
tenant that keeps sending short requests hold the others back only while it has been served no more than them.
"""

from __future__ import annotations

from collections.abc import Iterable

from paged_hf.core.request import Request
from paged_hf.core.request_queue import RankedQueue

ARRIVAL_WINDOW_STEPS = 16  # how long an arrival of a class in a hurry keeps the others' prefill capped
CAPPED_BUDGET_DIVISOR = 4  # the capped prefill: max_num_batched_tokens // 4 tokens a step


class StepPacer:
    def __init__(self, queue: RankedQueue, max_num_batched_tokens: int, window_steps: int = ARRIVAL_WINDOW_STEPS):
        self.queue = queue
        self.capped_budget = max(1, max_num_batched_tokens // CAPPED_BUDGET_DIVISOR)
        self.window_steps = window_steps
        self.arrivals: dict[object, int] = {}  # class -> the last step it had an arrival in (oldest first)
        self.num_untopped_steps = 0  # steps that carried a first prefill in a hurry and held a prefill chunk back
        self.num_capped_steps = 0  # other steps in which the cap limited a prefill chunk
        self.urgent: set[Request] = set()  # this step: first prefills of classes in a hurry
        self._untopped_by: set[object] = set()  # this step: classes whose first prefill it carries
        self._held_back = False  # this step: a prefill chunk was held back for them
        self._cap_keys: list[object] = []
        self._cap_left = 0
        self._decodes: set[Request] = set()  # this step: running requests that decode and have no token yet
        self._capped: set[Request] = set()  # this step: requests whose prefill the cap limits

    def arrive(self, request: Request, step: int) -> None:
        key = self.queue.class_of(request)
        self.arrivals.pop(key, None)
        self.arrivals[key] = step
        for old in [k for k, s in self.arrivals.items() if s < step - self.window_steps]:
            del self.arrivals[old]

    def begin(self, running: list[Request], waiting: Iterable[Request], step: int) -> None:
        """Before a step's scheduling: which first prefills are in a hurry, and whether prefill is capped."""
        queue, hurry = self.queue, {}
        queue.begin_step()

        def hurried(key: object) -> bool:
            if key not in hurry:
                hurry[key] = queue.in_hurry(key, running)
            return hurry[key]

        self.urgent = {r for group in (running, waiting) for r in group
                       if not r.output_token_ids and r.num_tokens_to_compute > 0 and hurried(queue.class_of(r))}
        self._untopped_by, self._held_back = set(), False
        self._decodes = {r for r in running if r.num_tokens_to_compute == 1}
        self._cap_keys = [k for k, s in self.arrivals.items() if s >= step - self.window_steps and hurried(k)]
        self._cap_left = self.capped_budget
        self._capped = set()

    def end(self) -> None:
        if self._held_back:
            self.num_untopped_steps += 1
        elif self._capped:
            self.num_capped_steps += 1
        self.urgent, self._capped, self._decodes = set(), set(), set()

    def order(self, request: Request) -> tuple:
        """Rank within the step: first prefills in a hurry go first, so that the step is un-topped before any
        request it holds back is given its tokens."""
        return request not in self.urgent, self.queue.rank(request)

    def limit(self, request: Request, num_new: int, budget: int) -> int:
        """The tokens of `num_new` the request may compute this step, `budget` left (0: none, it waits)."""
        if request.num_tokens_to_compute <= 1:
            return num_new  # decodes stay in
        if request in self.urgent:  # it goes first, but the decodes keep their tokens
            return min(num_new, max(1, budget - len(self._decodes)))
        num_new = min(num_new, max(0, budget - len(self._decodes)))  # whatever the order of the ranks
        holds_back = self.queue.holds_back
        if any(holds_back(key, request) for key in self._untopped_by):
            self._held_back = True
            return 0
        if any(holds_back(key, request) for key in self._cap_keys):
            self._capped.add(request)
            return min(num_new, self._cap_left)
        return num_new

    def scheduled(self, request: Request, num_new: int) -> None:
        """A request got `num_new` tokens this step: a first prefill in a hurry un-tops the step."""
        self._decodes.discard(request)
        if num_new and request in self.urgent:
            self._untopped_by.add(self.queue.class_of(request))
        elif request in self._capped:
            self._cap_left -= num_new
