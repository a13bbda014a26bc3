"""The waiting queue's policies: who is admitted next, who gives way, and in what order running requests get the
step's token budget.

- `fcfs` (the default) is a plain `deque`: arrival order, and the scheduler's original code path.
- `priority` (vLLM's meaning: lower first, ties in arrival order): a waiting request that outranks running
  ones may take the seat and blocks of the lowest-ranked running request (preempted: recomputed later, its
  output kept). vLLM's priority scheduling cannot preempt for a waiting request once `max_num_seqs` is full
  (vLLM #40004); here it can.
- `fair`: start-time fair queueing over tenants. Each tenant has a virtual token counter (tokens computed for
  it, prefill and decode alike, divided by its weight); the tenant with the smallest counter goes first, so
  over time each active tenant gets its weighted share of the step budget. A tenant that comes back after
  having nothing queued or running starts at the smallest counter of the active tenants: an idle tenant gives
  its share to the others and banks no credit. A tenant below its share of the seats may preempt a request of
  a tenant above its share (so a flood of long requests from one tenant cannot hold every seat), and never the
  other way round, which bounds the preemptions (no ping-pong).

Both ranked queues keep the `deque` methods the scheduler uses (`append`, `appendleft`, `extendleft`,
`popleft`, `remove`, `[0]`, iteration), but a request's place follows from its rank, not from the method.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator

from paged_hf.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
MAX_IDLE_COUNTERS = 4096  # fair: tenants' counters kept (the `user` field is the client's: unbounded names)


def make_waiting_queue(policy: str, tenant_weights: dict | None = None, max_num_seqs: int = 1):
    """The waiting queue of a scheduling policy; ValueError for an unknown one."""
    if policy == "fcfs":
        return deque()
    if policy == "priority":
        return PriorityQueue()
    if policy == "fair":
        return FairQueue(tenant_weights or {}, max_num_seqs)
    raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, SCHEDULING_POLICIES))}, got {policy!r}")


class RankedQueue:
    """Shared by the ranked policies: the deque interface over an order that `rank` defines."""

    others_may_pass = False  # whether other tenants' requests may start when the head finds no seat or blocks

    def rank(self, request: Request) -> tuple:
        raise NotImplementedError

    def victim(self, head: Request, pending: list[Request], running: list[Request]) -> Request | None:
        """The running request (one of `pending`: not yet scheduled this step, best first) whose seat and blocks
        the waiting `head` may take when it finds none free; None: it waits."""
        raise NotImplementedError

    def charge(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` of the request's were scheduled (fair: its tenant's counter)."""

    def arrive(self, request: Request, running: list[Request]) -> None:
        """A new request is about to be queued (fair: a returning tenant's counter catches up)."""

    # step pacing (step_pacing.py): who may hold back whose prefill. A request's class is what the policy ranks
    # it by (its priority, its tenant).
    def class_of(self, request: Request) -> object:
        raise NotImplementedError

    def in_hurry(self, key: object, running: list[Request]) -> bool:
        """Whether the class is owed service now before requests of another class, running or waiting (priority: it
        outranks one; fair: it holds fewer seats than its share and has been served no more than such a tenant)."""
        raise NotImplementedError

    def holds_back(self, key: object, other: Request) -> bool:
        """Whether a first prefill of class `key` may hold back `other`'s prefill chunks (this step)."""
        raise NotImplementedError

    def owed_seats(self, key: object, running: list[Request]) -> bool:
        """Whether the class holds fewer seats than its share (fair); priorities have no shares."""
        return False

    def owed_tokens(self, key: object, others: list[object]) -> int:
        """How many tokens the class may compute before it has been served as much as the most served of
        `others` (fair: the gap between their virtual counters, in its tokens); priorities owe none."""
        return 0

    def budget_share(self, key: object, running: list[Request]) -> float:
        """The class's share of a step's token budget (fair: its weight among the active tenants')."""
        return 1.0

    def begin_step(self, running: list[Request]) -> None:
        """A step's scheduling starts (fair: `holds_back` compares the counters and backlogs as they were now)."""

    def appendleft(self, request: Request) -> None:
        self.append(request)

    def extendleft(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.appendleft(request)

    def popleft(self) -> Request:
        request = self[0]
        self.remove(request)
        return request

    def __getitem__(self, index: int) -> Request:
        for i, request in enumerate(self):
            if i == index:
                return request
        raise IndexError("the waiting queue is shorter")

    def __bool__(self) -> bool:
        return len(self) > 0


class PriorityQueue(RankedQueue):
    """Sorted by (priority, arrival time): a preempted request goes back to its rank, ahead of later arrivals."""

    def __init__(self):
        self._items: list[Request] = []

    def rank(self, request: Request) -> tuple:
        return request.priority, request.arrival_time

    def victim(self, head: Request, pending: list[Request], running: list[Request]) -> Request | None:
        """The lowest-ranked pending request, if the head outranks it (equal priorities never preempt)."""
        return pending[-1] if pending and head.priority < pending[-1].priority else None

    def class_of(self, request: Request) -> object:
        return request.priority

    def in_hurry(self, key: object, running: list[Request]) -> bool:
        """It outranks a running request, or a waiting one that would otherwise share its first step (an urgent
        request that comes with a flood, nothing running yet)."""
        return any(r.priority > key for r in running) or bool(self._items and self._items[-1].priority > key)

    def holds_back(self, key: object, other: Request) -> bool:
        """Only what ranks lower: equal priorities never hold each other back."""
        return other.priority > key

    def append(self, request: Request) -> None:
        bisect.insort_right(self._items, request, key=self.rank)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)


class FairQueue(RankedQueue):
    """One FIFO per tenant; tenants in order of their virtual token counters (ties: the older head first). A
    tenant whose head finds no seat or blocks holds up only itself this step."""

    others_may_pass = True

    def __init__(self, tenant_weights: dict, max_num_seqs: int):
        self.tenant_weights = dict(tenant_weights)
        self.max_num_seqs = max_num_seqs
        self.served: dict[str | None, float] = {}  # tenant -> virtual tokens (tokens / weight)
        self._step_served: dict[str | None, float] = {}  # `served` as the step's scheduling started
        self._step_running: list[Request] = []  # the running requests as the step's scheduling started
        self._step_backlog: dict[str | None, int] = {}  # tenant -> tokens its requests have left, when first asked
        self._queues: dict[str | None, deque[Request]] = {}

    def weight(self, tenant: str | None) -> float:
        return float(self.tenant_weights.get(tenant, 1.0))

    def rank(self, request: Request) -> tuple:
        return self.served.get(request.tenant, 0.0), request.arrival_time

    def charge(self, request: Request, num_tokens: int) -> None:
        self.served[request.tenant] = self.served.get(request.tenant, 0.0) + num_tokens / self.weight(request.tenant)

    def arrive(self, request: Request, running: list[Request]) -> None:
        tenant = request.tenant
        if self._queues.get(tenant) or any(r.tenant == tenant for r in running):
            return  # active already
        active = {t for t, q in self._queues.items() if q} | {r.tenant for r in running}
        if len(self.served) > MAX_IDLE_COUNTERS:  # idle tenants' counters only matter above the floor: drop them
            self.served = {t: v for t, v in self.served.items() if t in active}
        floor = min((self.served.get(t, 0.0) for t in active), default=None)
        if floor is not None:
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)

    def seat_share(self, tenant: str | None, active: set) -> float:
        """The tenant's weighted share of max_num_seqs among the active tenants."""
        return self.max_num_seqs * self.weight(tenant) / sum(self.weight(t) for t in active)

    def victim(self, head: Request, pending: list[Request], running: list[Request]) -> Request | None:
        """While the head's tenant holds fewer seats than its share: the lowest-ranked pending request of a
        tenant that holds more than its share."""
        active = self._active(head.tenant, running)
        seats: dict[str | None, int] = {}
        for request in running:
            seats[request.tenant] = seats.get(request.tenant, 0) + request.num_seats
        if seats.get(head.tenant, 0) >= self.seat_share(head.tenant, active):
            return None
        for request in reversed(pending):
            if request.tenant != head.tenant and seats.get(request.tenant, 0) > self.seat_share(request.tenant, active):
                return request
        return None

    def class_of(self, request: Request) -> object:
        return request.tenant

    def in_hurry(self, key: object, running: list[Request]) -> bool:
        """Below its seat share, and served no more than another tenant with a request running or waiting (which
        it may hold back): a short request that comes with a flood is owed its first token before the flood's."""
        heads = [q[0] for tenant, q in self._queues.items() if q and tenant != key]
        if not any(self.holds_back(key, r) for group in (running, heads) for r in group):
            return False
        return self.owed_seats(key, running)

    def _active(self, key: object, running: list[Request]) -> set:
        return {t for t, q in self._queues.items() if q} | {r.tenant for r in running} | {key}

    def owed_seats(self, key: object, running: list[Request]) -> bool:
        seats = sum(r.num_seats for r in running if r.tenant == key)
        return seats < self.seat_share(key, self._active(key, running))

    def budget_share(self, key: object, running: list[Request]) -> float:
        return self.weight(key) / sum(self.weight(t) for t in self._active(key, running))

    def owed_tokens(self, key: object, others: list[object]) -> int:
        served = self._step_served.get
        gap = max((served(other, 0.0) for other in others), default=0.0) - served(key, 0.0)
        return max(0, int(gap * self.weight(key)))

    def holds_back(self, key: object, other: Request) -> bool:
        """Another tenant's, and only while that tenant has been served more than this one (virtual tokens, at the
        step's start), or as much with as much or more left to do: a tenant that keeps sending short requests
        cannot hold the others' prefill back for ever, and of two tenants level (at the start, or one back from
        idle at the other's count) the one with the smaller backlog goes first, not both."""
        served = self._step_served.get
        if other.tenant == key:
            return False
        mine, theirs = served(key, 0.0), served(other.tenant, 0.0)
        return theirs > mine or (theirs == mine and self._backlog(other.tenant) >= self._backlog(key))

    def _backlog(self, tenant: object) -> int:
        """The tokens the tenant's requests have left, at most (to compute, and new tokens still allowed); summed
        once a step, only for the tenants of a tie."""
        if tenant not in self._step_backlog:
            requests = [*(r for r in self._step_running if r.tenant == tenant), *self._queues.get(tenant, ())]
            self._step_backlog[tenant] = sum(r.num_tokens_to_compute + r.sampling_params.max_new_tokens
                                             - len(r.output_token_ids) for r in requests)
        return self._step_backlog[tenant]

    def begin_step(self, running: list[Request]) -> None:
        self._step_served = dict(self.served)
        self._step_running, self._step_backlog = list(running), {}

    def append(self, request: Request) -> None:
        self._queues.setdefault(request.tenant, deque()).append(request)

    def appendleft(self, request: Request) -> None:
        self._queues.setdefault(request.tenant, deque()).appendleft(request)

    def remove(self, request: Request) -> None:
        queue = self._queues[request.tenant]
        queue.remove(request)
        if not queue:
            del self._queues[request.tenant]

    def _tenant_order(self) -> list[deque[Request]]:
        queues = [q for q in self._queues.values() if q]
        return sorted(queues, key=lambda q: self.rank(q[0]))

    def __iter__(self) -> Iterator[Request]:
        return iter([request for queue in self._tenant_order() for request in queue])

    def __getitem__(self, index: int) -> Request:
        if index == 0:
            queues = self._tenant_order()
            if queues:
                return queues[0][0]
        return super().__getitem__(index)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())
