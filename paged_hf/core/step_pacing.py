"""Short steps while a request in a hurry waits for its first token (`priority` and `fair` only; fcfs never
comes here).

A request that arrives while a step runs waits for that step, then for its own. Under a flood of long prompts both
are full of the flood's prefill chunks (the whole token budget), so the newcomer's first token costs two long
steps. These rules make both steps short; the running requests' decodes wait at most one step:

- Un-topped step: a step that carries the first prefill (the chunks before its first token) of a request whose
  class is in a hurry (`priority`: it outranks a running or waiting request; `fair`: its tenant holds fewer seats
  than its share and has been served no more than a tenant with a request running or waiting) gives no prefill
  chunk to the requests that class may hold back (lower priorities; other tenants served as much or more), and
  starts none of them. Their decodes stay in (split decodes below): such first prefills go first in the step, but
  leave the budget's room for the decodes.
- Capped prefill: while a class in a hurry had an arrival in the last `window_steps` steps (another one may come
  any moment), the prefill chunks of the requests it may hold back share a capped number of tokens a step, so the
  step in flight when the next one comes is short too. The cap adapts to the hardware: the pacer times its steps
  (`StepCost`: seconds = fixed + per_token * tokens, fitted over recent steps) and caps a step at what lasts
  `CAPPED_STEP_FACTOR` (1.25) times the hurried class's own first step (the decodes and its first prefill). Where a
  step's fixed cost dominates (a GPU, or tiny steps), that lifts the cap: a full step costs little more than the
  short one, and a capped step would only add steps. It never goes below `max_num_batched_tokens // 16`; before
  any step was timed it is `max_num_batched_tokens // 4`. Under `fair`, while another tenant below its seat
  share had an arrival in the window, a hurried tenant's own first prefills take at most what it is owed (the
  gap between the counters) or the cap, whichever is more: both are owed service, and the other's next request
  must not wait out a whole step of this one's prefill (two tenants that arrive together: the smaller backlog
  goes first, then the flood catches up in capped steps). Once the other's first prefills held it back
  OFTEN_HELD_BACK times in the window (it arrives about every step), it takes its budget share instead.
- Split decodes: while the cap holds, the decodes of the requests it limits run in alternate halves (at most
  half of them, rounded up, a step; those left out the step before go first), so that both the step in flight
  and the hurried request's own step are short. None waits more than one step for its token.
- Whatever the ranks' order, a prefill chunk leaves the budget's room for the running requests' decodes.

All of it only holds back, never preempts, so nothing starves that did not before: fair's `holds_back` lets a
tenant that keeps sending short requests hold the others back only while it has been served no more than them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from paged_hf.core.request import Request
from paged_hf.core.request_queue import RankedQueue

ARRIVAL_WINDOW_STEPS = 16  # how long an arrival of a class in a hurry keeps the others' prefill capped
OFTEN_HELD_BACK = 4  # fair: held back in this many of the window's steps, a hurried tenant takes its budget share
CAPPED_BUDGET_DIVISOR = 4  # the cap before any step was timed: budget // 4 a step
LEAST_CAP_DIVISOR = 16  # the least timed cap: budget // 16 a step
CAPPED_STEP_FACTOR = 1.25  # a capped step lasts at most this many times the hurried class's own first step
COST_DECAY = 0.9  # StepCost: the weight of a step's timing decays by this factor a step (recent steps count most)
SLOW_STEP_FACTOR = 2.0  # StepCost: a step timed slower than this many times the fit's seconds counts as that many
REACH_FACTOR = 2  # a capped step carries at most this many times the tokens of the largest step timed so far


class StepCost:
    """A step's seconds as `fixed + per_token * tokens`, fitted by exponentially weighted least squares over the
    timed steps (the fit follows the load of a shared host); none until steps of different sizes were timed.

    A step slower than SLOW_STEP_FACTOR times the fit counts as that slow: one pause (a collection, a neighbour's
    burst) would otherwise read as a large fixed cost and a small one per token for a dozen steps, and the cap
    that follows from such a fit is the whole budget. A host that stays slower moves the fit up step by step."""

    def __init__(self, decay: float = COST_DECAY):
        self.decay = decay
        self.sums = [0.0] * 5  # weighted: 1, tokens, seconds, tokens^2, tokens * seconds
        self.largest = 0  # the most tokens a timed step had

    def observe(self, num_tokens: int, seconds: float) -> None:
        fit = self.fit()
        if fit is not None:
            seconds = min(seconds, SLOW_STEP_FACTOR * (fit[0] + fit[1] * num_tokens))
        self.largest = max(self.largest, num_tokens)
        x, y = float(num_tokens), float(seconds)
        self.sums = [self.decay * s + v for s, v in zip(self.sums, (1.0, x, y, x * x, x * y))]

    def fit(self) -> tuple[float, float] | None:
        """-> (fixed seconds, seconds per token), or None while the timings say nothing (too few, all of one size,
        or no cost per token)."""
        w, sx, sy, sxx, sxy = self.sums
        if w <= 0 or sx <= 0:
            return None
        var = sxx / w - (sx / w) ** 2
        if var <= 1e-9 * (sxx / w):
            return None
        per_token = (sxy / w - sx * sy / w / w) / var
        fixed = sy / w - per_token * sx / w
        if per_token <= 0:
            return None
        if fixed < 0:  # no fixed cost visible: proportional
            return 0.0, sy / sx
        return fixed, per_token

    def tokens_within(self, seconds: float, fit: tuple[float, float]) -> float:
        """The tokens of a step that lasts `seconds` by `fit` (this cost's). A fit says little of steps much
        larger than those it was fitted on (the first steps of a run are small and few): at most REACH_FACTOR
        times the largest step timed, so a bound reaches a full budget in a few steps where the fit says it may."""
        fixed, per_token = fit
        return min((seconds - fixed) / per_token, REACH_FACTOR * self.largest)


class StepTimer:
    """Times the engine's steps for a StepCost: the scheduler calls `begin` as a step's scheduling begins and
    `scheduled` with the tokens it gave out."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.cost = StepCost()
        self._step_start: float | None = None  # when the last step's scheduling began
        self._cold = True  # the engine's first step is not timed (see begin)
        self._step_tokens = 0  # the tokens the last step scheduled

    def begin(self, running: list[Request]) -> None:
        """The time since the last step's scheduling began is that step's (scheduling, forward, outputs), unless
        the engine idled in between: only timed while requests ran on from it. The engine's first step is not
        timed: it pays for what is set up once (kernels loaded, buffers allocated), several times a step's cost."""
        now = self.clock()
        if self._step_start is not None and self._step_tokens and running:
            if not self._cold:
                self.cost.observe(self._step_tokens, now - self._step_start)
            self._cold = False
        self._step_start, self._step_tokens = now, 0

    def scheduled(self, num_tokens: int) -> None:
        self._step_tokens += num_tokens


class StepPacer:
    def __init__(self, queue: RankedQueue, max_num_batched_tokens: int, window_steps: int = ARRIVAL_WINDOW_STEPS,
                 timer: StepTimer | None = None):
        self.queue = queue
        self.max_num_batched_tokens = max_num_batched_tokens
        self.capped_budget = max(1, max_num_batched_tokens // CAPPED_BUDGET_DIVISOR)  # the cap before timings
        self.least_cap = max(1, max_num_batched_tokens // LEAST_CAP_DIVISOR)
        self.window_steps = window_steps
        self.timer = timer if timer is not None else StepTimer()  # the scheduler's, which times its steps
        self.hurried_prefill_tokens = 0  # the tokens of the last first prefill in a hurry that a step carried
        self.arrivals: dict[object, int] = {}  # class -> the last step it had an arrival in (oldest first)
        self.num_untopped_steps = 0  # steps that carried a first prefill in a hurry and held a prefill chunk back
        self.num_capped_steps = 0  # other steps in which the cap limited a prefill chunk
        self.urgent: set[Request] = set()  # this step: first prefills of classes in a hurry
        self._untopped_by: set[object] = set()  # this step: classes whose first prefill it carries
        self._held_back = False  # this step: a prefill chunk was held back for them
        self._cap_keys: list[object] = []
        self._share_left: dict[object, int] = {}  # this step: hurried classes' prefill tokens left (fair, see above)
        self._held_back_at: dict[object, list[int]] = {}  # class -> the recent steps that held its prefill back
        self._step = 0
        self._cap_left = 0
        self._decodes: set[Request] = set()  # this step: running requests that decode and have no token yet
        self._split: set[Request] = set()  # this step: decodes that run in alternate halves (split decodes)
        self._split_left = 0  # this step: how many of them may still run
        self._left_out: set[Request] = set()  # this step: split decodes left out (they go first the next step)
        self._left_out_before: set[Request] = set()  # the step before's
        self._capped: set[Request] = set()  # this step: requests whose prefill the cap limits
        self._cap_limited = False  # this step: the cap cut a prefill chunk short

    def arrive(self, request: Request, step: int) -> None:
        key = self.queue.class_of(request)
        self.arrivals.pop(key, None)
        self.arrivals[key] = step
        for old in [k for k, s in self.arrivals.items() if s < step - self.window_steps]:
            del self.arrivals[old]

    def begin(self, running: list[Request], waiting: Iterable[Request], step: int) -> None:
        """Before a step's scheduling: which first prefills are in a hurry, and whether prefill is capped."""
        queue, hurry = self.queue, {}
        queue.begin_step(running)

        def hurried(key: object) -> bool:
            if key not in hurry:
                hurry[key] = queue.in_hurry(key, running)
            return hurry[key]

        self.urgent = {r for group in (running, waiting) for r in group
                       if not r.output_token_ids and r.num_tokens_to_compute > 0 and hurried(queue.class_of(r))}
        self._untopped_by, self._held_back = set(), False
        self._decodes = {r for r in running if r.num_tokens_to_compute == 1}
        recent = [k for k, s in self.arrivals.items() if s >= step - self.window_steps]
        self._cap_keys = [k for k in recent if hurried(k)]
        holds_back = queue.holds_back
        self._split = {r for r in self._decodes if any(holds_back(k, r) for k in self._cap_keys)}
        self._split_left = (len(self._split) + 1) // 2
        self._cap_left = self.cap(len(self._decodes) - len(self._split) + self._split_left)
        self._step = step
        since = step - self.window_steps
        self._held_back_at = {k: [s for s in steps if s >= since] for k, steps in self._held_back_at.items()
                              if steps[-1] >= since}
        owed = [k for k in recent if queue.owed_seats(k, running)]
        self._share_left = {k: self._hurried_allowance(k, [o for o in owed if o != k], running)
                            for k in {queue.class_of(r) for r in self.urgent} if any(o != k for o in owed)}
        self._capped, self._cap_limited = set(), False

    def _hurried_allowance(self, key: object, owed: list[object], running: list[Request]) -> int:
        """A hurried class's first-prefill tokens this step while `owed` classes keep arriving: what it is owed
        (the gap to their counters), at least the cap; its budget share once their first prefills held it back
        OFTEN_HELD_BACK times in the window (they arrive about every step: un-topped steps must not eat its share)."""
        allowance = max(self._cap_left, self.queue.owed_tokens(key, owed))
        if len(self._held_back_at.get(key, ())) >= OFTEN_HELD_BACK:
            allowance = max(allowance, int(self.max_num_batched_tokens * self.queue.budget_share(key, running)))
        return allowance

    @property
    def cost(self) -> StepCost:
        return self.timer.cost

    def cap(self, num_decodes: int) -> int:
        """The capped prefill's tokens this step: what keeps the step within CAPPED_STEP_FACTOR times the hurried
        class's own first step (the same decodes plus its first prefill), at least the least cap, growing as
        StepCost.tokens_within allows."""
        fit = self.cost.fit()
        if fit is None:
            return self.capped_budget
        fixed, per_token = fit
        own_step = fixed + per_token * (num_decodes + self.hurried_prefill_tokens)
        step_tokens = self.cost.tokens_within(CAPPED_STEP_FACTOR * own_step, fit)
        return max(self.least_cap, min(self.max_num_batched_tokens, int(step_tokens) - num_decodes))

    def end(self) -> None:
        if self._held_back:
            self.num_untopped_steps += 1
        elif self._cap_limited:
            self.num_capped_steps += 1
        self.urgent, self._capped, self._decodes, self._split = set(), set(), set(), set()
        self._left_out_before, self._left_out = self._left_out, set()

    def order(self, request: Request) -> tuple:
        """Rank within the step: first prefills in a hurry go first, so that the step is un-topped before any
        request it holds back is given its tokens."""
        return request not in self.urgent, request not in self._left_out_before, self.queue.rank(request)

    def limit(self, request: Request, num_new: int, budget: int) -> int:
        """The tokens of `num_new` the request may compute this step, `budget` left (0: none, it waits)."""
        if request.num_tokens_to_compute <= 1:
            if request in self._split:
                if not self._split_left:
                    self._left_out.add(request)
                    self._decodes.discard(request)  # no room kept for it
                    return 0
                self._split_left -= 1
            return num_new  # decodes stay in (split ones in alternate halves)
        if request in self.urgent:  # it goes first, but the decodes keep their tokens
            num_new = min(num_new, max(1, budget - len(self._decodes)))
            return min(num_new, max(0, self._share_left.get(self.queue.class_of(request), num_new)))
        num_new = min(num_new, max(0, budget - len(self._decodes)))  # whatever the order of the ranks
        holds_back = self.queue.holds_back
        if any(holds_back(key, request) for key in self._untopped_by):
            self._held_back = True
            held = self._held_back_at.setdefault(self.queue.class_of(request), [])
            if not held or held[-1] != self._step:
                held.append(self._step)
            return 0
        if any(holds_back(key, request) for key in self._cap_keys):
            self._capped.add(request)
            self._cap_limited = self._cap_limited or num_new > self._cap_left
            return min(num_new, self._cap_left)
        return num_new

    def scheduled(self, request: Request, num_new: int) -> None:
        """A request got `num_new` tokens this step: a first prefill in a hurry un-tops the step."""
        self._decodes.discard(request)
        if num_new and request in self.urgent:
            key = self.queue.class_of(request)
            self._untopped_by.add(key)
            self.hurried_prefill_tokens = num_new
            if key in self._share_left:
                self._share_left[key] -= num_new
        elif request in self._capped:
            self._cap_left -= num_new
