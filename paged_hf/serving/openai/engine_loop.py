"""The one thread that owns the generator, and the asyncio side that talks to it.

Why one thread: the engine (`EngineFace`, paged_hf/engine/face.py) is not thread-safe and `step()` blocks for the
whole forward pass. The event loop must never block on it, and two threads must never call it at once. So HTTP
handlers only put commands (`Add`, `Abort`, `Call`, `Drain`, `Stop`: small dataclasses) on a thread-safe queue; the engine thread drains that queue before every step, runs
`step()` while there is work (sleeping on the queue when there is none), and hands each `RequestOutput` to the
waiting handler's asyncio queue with `loop.call_soon_threadsafe`. An abort is therefore applied before the
next step: a client that goes away frees its blocks within one step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass

import torch
from transformers.utils import logging

from paged_hf.engine.face import EngineFace, EngineLimits
from paged_hf.serving.openai.metrics import ServerMetrics
from paged_hf.serving.openai.request_stream import RequestStream, deliver_all

logger = logging.get_logger(__name__)


def reserve_torch_threads() -> int:
    """Keep torch's intra-op threads for the engine thread: the calling (main) thread computes on one from now
    on. -> the thread count torch had, for `EngineLoop(num_threads=...)`. Call before the main thread runs any
    torch op (model loading included).

    Why: libgomp cuts its workers' spin-wait to ~100 spins when it manages more threads than there are CPUs.
    With the main thread (which loads the model) and the engine thread each owning a team of 2 on a 2-core
    machine, the engine's worker sleeps between parallel regions and is woken by a futex for every one of
    them: measured, `generate()` in a second thread ran 218 tok/s on 0.94 cores with 35k voluntary context
    switches, in the main thread 379 tok/s on 1.8 cores with 2; with the main thread on one thread, the second
    thread ran 380 tok/s on 1.8 cores."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return num_threads


class QueueFullError(Exception):
    """The server already holds --max-queue unfinished requests (HTTP 503)."""


class EngineError(Exception):
    """The engine failed while running a request (not the client's fault: HTTP 500)."""


@dataclass
class Add:
    """Queue a request: `accepted` is resolved on the stream's loop when the engine took it (or refused it)."""
    stream: RequestStream
    prompt_token_ids: list[int]
    params: object  # SamplingParams, or PoolingParams for an embedding
    adapter: str | None
    cache_salt: str | None
    priority: int
    tenant: str | None
    accepted: asyncio.Future


@dataclass
class Abort:
    request_id: str


@dataclass
class Call:
    """`fn(engine)` between two steps; its result or exception resolves `done` on `loop`."""
    fn: object
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass
class Drain:
    """Take nothing new; abort what still runs at `deadline` (time.monotonic())."""
    deadline: float


class Stop:
    """Abort what is left and end the engine thread."""


class EngineLoop:
    def __init__(self, generator: EngineFace, metrics: ServerMetrics, max_queue: int = 256,
                 num_threads: int | None = None):
        """`num_threads`: torch's intra-op threads on the engine thread (see `reserve_torch_threads`); None:
        torch's setting for a new thread."""
        self.generator = generator
        self.limits: EngineLimits = generator.limits  # fixed: read from any thread
        self.num_threads = num_threads
        self.metrics = metrics
        self.max_queue = max_queue
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self.draining = False
        self._abort_at: float | None = None  # drain deadline (engine thread)
        self._thread: threading.Thread | None = None
        # Snapshots the engine thread refreshes, so other threads never call the generator themselves.
        self.stats: dict = generator.stats()
        self.adapter_names: tuple[str, ...] = tuple(generator.adapter_names())

    # --- event-loop side ---------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="paged_hf-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, free its blocks and end the thread."""
        if self._thread is None:
            return
        self._commands.put(Stop())
        self._thread.join(timeout)
        self._thread = None

    def reserve(self) -> None:
        """Count a request against --max-queue before any work is done for it (tokenizing a large prompt
        included); raises QueueFullError. Every reservation ends in `submit` or `release`."""
        with self._lock:
            if self.draining:
                raise QueueFullError("the server is shutting down")
            if self._num_in_flight >= self.max_queue:
                raise QueueFullError(f"the server is at capacity ({self.max_queue} requests); retry later")
            self._num_in_flight += 1

    def release(self) -> None:
        """Give back a reservation that will not be submitted (bad input found while preparing it)."""
        self._release(1)

    def drain(self, grace_s: float) -> None:
        """Thread-safe (a signal handler calls it): take no new request; what runs may finish for `grace_s`
        seconds, then it is aborted and each request's last output says finish_reason "abort"."""
        self.draining = True
        self._commands.put(Drain(time.monotonic() + grace_s))

    async def submit(self, request_id: str, prompt_token_ids: list[int], params, adapter: str | None,
                     arrival_time: float, reserved: bool = False, cache_salt: str | None = None, priority: int = 0,
                     tenant: str | None = None, owner: str | None = None) -> RequestStream:
        """Queue a request; raises QueueFullError, or the generator's ValueError for bad input. `reserved`: the
        caller already holds its slot (`reserve()`)."""
        if not reserved:
            self.reserve()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, arrival_time, tenant=tenant or adapter or "", tenant_owner=owner)
        accepted = loop.create_future()
        self._commands.put(Add(stream, prompt_token_ids, params, adapter, cache_salt, priority, tenant, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left while we waited: the add still happens, undo it
            self.abort(request_id)
            raise
        return stream

    async def call(self, fn):
        """`fn(engine)` on the engine thread, between two steps (the engine is not thread-safe): its result, or
        the exception it raised (e.g. loading or unloading an adapter)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(Call(fn, loop, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for a request that already finished."""
        self._commands.put(Abort(request_id))

    # --- engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        """Until stopped. Whatever goes wrong inside one iteration fails the requests in flight, never the
        thread: a dead engine thread would leave every later request waiting forever."""
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        running = True
        while running:
            try:
                running = self._iteration()
            except Exception as exc:  # noqa: BLE001
                logger.error("engine loop failed; aborting %d requests", len(self._streams), exc_info=True)
                self._fail_all(EngineError(f"the engine failed: {type(exc).__name__}: {exc}"))
        self._shutdown()

    def _iteration(self) -> bool:
        busy = self.generator.has_unfinished_requests()
        if not self._drain_commands(block=not busy):
            return False
        if self._abort_at is not None and time.monotonic() >= self._abort_at:
            self._abort_at = float("inf")
            for request_id in list(self._streams):  # their "abort" outputs reach the clients with the next step
                self.generator.abort(request_id)
        if self.generator.has_unfinished_requests():
            self._step()
        self._refresh_snapshots()
        return True

    def _drain_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when idle); False once asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, Stop):
                return False
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, Drain):
                self._abort_at = min(command.deadline, self._abort_at or command.deadline)
            elif isinstance(command, Call):
                self._call(command)
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, add: Add) -> None:
        stream = add.stream
        try:
            if self._abort_at is not None:  # prepared while the server began to drain: answer it now
                raise QueueFullError("the server is shutting down")
            self.generator.add_request(add.prompt_token_ids, add.params, adapter=add.adapter,
                                       request_id=stream.request_id, cache_salt=add.cache_salt,
                                       priority=add.priority, tenant=add.tenant)
        except Exception as exc:  # noqa: BLE001 - ValueError is the client's, anything else goes back too
            self._release(1)
            _resolve(stream.loop, add.accepted, exc)
            return
        stream.num_sequences = add.params.n
        self._streams[stream.request_id] = stream
        _resolve(stream.loop, add.accepted, None)

    def _call(self, call: Call) -> None:
        try:
            result = call.fn(self.generator)
        except Exception as exc:  # noqa: BLE001 - goes back to the caller
            _resolve(call.loop, call.done, exc)
            return
        self._refresh_snapshots()  # e.g. /v1/models lists a new adapter as soon as the call returns
        _resolve(call.loop, call.done, None, result)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.generator.abort(request_id)  # blocks back now; its "abort" output is dropped at the next step
        self.metrics.count_finished("abort", sum(stream.num_tokens_seen.values()), stream.num_sequences)
        self._release(1)

    def _step(self) -> None:
        outputs = self.generator.step()  # an exception (the model failed) is handled in _run
        now = time.monotonic()
        self._mark_started(now)
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted: nobody waits for it
                continue
            try:
                self._observe(stream, output, now)
            except Exception as exc:  # noqa: BLE001 - belongs to this request: fail it, not the others
                self.generator.abort(output.request_id)
                output.error = f"{type(exc).__name__}: {exc}"
            if output.error is not None:
                logger.error("request %s failed: %s", output.request_id, output.error)
                deliveries.append((stream, EngineError(f"the request failed in the engine: {output.error}")))
            else:
                deliveries.append((stream, output))
            if output.finished or output.error is not None:
                del self._streams[output.request_id]
                self._release(1)
        deliver_all(deliveries)

    def _mark_started(self, now: float) -> None:
        """Queue time ends when the engine first computes any of the request's tokens (`has_started`)."""
        for request_id, stream in self._streams.items():
            if stream.started:
                continue
            if self.generator.has_started(request_id):
                stream.started = True
                self.metrics.observe(queue_time=now - stream.arrival_time)
                self.metrics.observe_tenant(stream.tenant, queue_time=now - stream.arrival_time,
                                            owner=stream.tenant_owner)

    def _observe(self, stream: RequestStream, output, now: float) -> None:
        if not isinstance(output.outputs, list):  # an embedding (EmbeddingRequestOutput): no tokens, one output
            self.metrics.observe(e2e=now - stream.arrival_time)
            return
        for completion in output.outputs:
            num_tokens = len(completion.token_ids)
            num_seen = stream.num_tokens_seen.get(completion.index, 0)
            if num_tokens > num_seen:
                last = stream.last_token_time.get(completion.index)
                self.metrics.observe_tenant(stream.tenant, generation_tokens=num_tokens - num_seen,
                                            ttft=None if last is not None else now - stream.arrival_time,
                                            owner=stream.tenant_owner)
                if last is None:
                    self.metrics.observe(ttft=now - stream.arrival_time)
                else:
                    for _ in range(num_tokens - num_seen):
                        self.metrics.observe(itl=(now - last) / (num_tokens - num_seen))
                stream.num_tokens_seen[completion.index] = num_tokens
                stream.last_token_time[completion.index] = now
        if output.finished:
            self.metrics.observe(e2e=now - stream.arrival_time)
            for completion in output.outputs:
                self.metrics.count_finished(completion.finish_reason or "unknown", len(completion.token_ids))

    def _fail_all(self, error: Exception) -> None:
        """Every request in flight gets `error`, and the generator is left empty (blocks free)."""
        streams, self._streams = self._streams, {}
        self._release(len(streams))
        deliver_all([(stream, error) for stream in streams.values()])
        try:
            for request_id in streams:
                self.generator.abort(request_id)
            while self.generator.has_unfinished_requests():  # hand the aborted requests' final outputs back
                self.generator.step()
        except Exception:  # noqa: BLE001 - must not escape: _run calls this from its own error handler
            logger.error("engine still failing after aborting every request", exc_info=True)

    def _shutdown(self) -> None:
        self._fail_all(EngineError("the server is shutting down"))
        self._refresh_snapshots()

    def _release(self, count: int) -> None:
        with self._lock:
            self._num_in_flight -= count

    def _refresh_snapshots(self) -> None:
        self.stats = self.generator.stats()
        self.adapter_names = tuple(self.generator.adapter_names())


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: Exception | None, result=None) -> None:
    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # loop closed
        pass
