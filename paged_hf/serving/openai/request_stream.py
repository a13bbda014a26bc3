"""One request as its HTTP handler sees it (`RequestStream`), and how the engine thread hands a step's outputs to
the event loops that wait for them (`deliver_all`): one thread-safe call per loop and step."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)
class RequestStream:
    """One request as the HTTP handler sees it: outputs arrive through `put` on its event loop and are taken
    with `get` (an `EngineError` ends it). A deque and one future per wait, not an asyncio.Queue: the wait for
    each output is the server's most frequent operation, and Python 3.11's `wait_for` makes a Task for it."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    arrival_time: float = field(default_factory=time.monotonic)
    items: deque = field(default_factory=deque)
    _waiter: asyncio.Future | None = None
    # engine-thread bookkeeping for the latency metrics
    num_sequences: int = 1  # n
    tenant: str = ""  # the per-tenant metrics' label (metrics.py)
    tenant_owner: str | None = None  # the API key those series belong to (tenancy.py; None without tenants)
    started: bool = False
    num_tokens_seen: dict = field(default_factory=dict)  # child index -> tokens delivered
    last_token_time: dict = field(default_factory=dict)  # child index -> time of its last token

    def deliver(self, item) -> None:
        """Engine thread -> event loop. A closed loop (server shutting down) has nobody left to tell."""
        deliver_all([(self, item)])

    def put(self, item) -> None:
        """On the event loop: queue an output and wake the waiting handler."""
        self.items.append(item)
        _wake(self._waiter)

    async def get(self, timeout: float | None = None):
        """On the event loop: the next output, or None after `timeout` seconds without one (None: no limit)."""
        if not self.items:
            waiter = self._waiter = self.loop.create_future()
            timer = None if timeout is None else self.loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self.items:
                return None
        return self.items.popleft()


def _wake(waiter: asyncio.Future | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def deliver_all(deliveries: list[tuple[RequestStream, object]]) -> None:
    """Hand a whole step's outputs to the event loop in one call per loop (each call wakes the loop and takes
    its lock: once per step, not once per request)."""
    by_loop: dict = {}
    for stream, item in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # a closed loop (server shutting down) has nobody left to tell
            pass


def _put_all(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream.put(item)
