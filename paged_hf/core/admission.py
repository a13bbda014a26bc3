"""What a waiting request waits for besides seats, blocks and budget: being ready, and an adapter slot.

- `is_ready` (e.g. the adapter store: its adapter is still being read from disk): a request for which it says
  False is not started this step. It keeps its place, later requests may pass it, and the wait has no bound
  here (the store bounds it) and is not counted against fairness.
- Adapter slots: at most `max_loras` distinct adapters run at once, so every step fits the device slots. A
  request of another adapter waits while later ones pass it, until a running adapter's requests finish. That
  wait is bounded (issue: a stream of requests for resident adapters starved the others, vLLM #16876): once a
  request has been passed over for `max_adapter_wait_steps` steps nobody passes it any more, the running
  adapters drain, and it gets a slot, together with its adapter's group (the waiting requests of the same
  adapter fit as soon as it runs). Adapters are swapped when one drains, never step by step: no thrashing.
"""

from __future__ import annotations

from collections.abc import Callable

from paged_hf.core.request import Request


class AdmissionGate:
    def __init__(self, max_loras: int | None = None, is_ready: Callable[[Request], bool] | None = None,
                 max_adapter_wait_steps: int = 64):
        self.max_loras = max_loras  # distinct adapters among the running requests (so in any step); None: no limit
        self.is_ready = is_ready
        self.max_adapter_wait_steps = max_adapter_wait_steps
        self.num_steps = 0
        self.adapter_waits: dict[Request, int] = {}  # passed over for an adapter slot -> since which step

    def running_adapters(self, running: list[Request]) -> set[int] | None:
        """Adapter versions (one per loaded adapter) the running requests use; None when unlimited."""
        if self.max_loras is None:
            return None
        return {r.adapter_version for r in running if r.adapter_version is not None}

    def adapter_fits(self, request: Request, adapters: set[int]) -> bool:
        """When nothing runs, anything fits, so no request waits forever for a slot."""
        version = request.adapter_version
        return version is None or version in adapters or len(adapters) < self.max_loras

    def admissible(self, request: Request, adapters: set[int] | None) -> bool:
        """Ready and its adapter fits the slots; a request that waits for a slot is recorded. A request whose next
        token a pipeline's micro-batch still computes (preempted meanwhile) starts once it is back."""
        if request.in_flight or (self.is_ready is not None and not self.is_ready(request)):
            return False
        if adapters is None or self.adapter_fits(request, adapters):
            return True
        self.adapter_waits.setdefault(request, self.num_steps)
        return False

    def blocks_queue(self, request: Request) -> bool:
        """Passed over for an adapter slot for max_adapter_wait_steps steps: nobody passes it now."""
        since = self.adapter_waits.get(request)
        return since is not None and self.num_steps - since >= self.max_adapter_wait_steps

    def forget(self, request: Request) -> None:
        """The request started or finished."""
        self.adapter_waits.pop(request, None)
