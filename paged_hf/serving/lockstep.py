"""Tensor or pipeline parallelism behind the server: rank 0 takes requests, every other rank mirrors its engine in
lockstep.

Under `tp_plan="auto"` every rank must run the same schedule on the same requests (the model's collectives
pair up step by step). The HTTP server only runs on rank 0, so rank 0's generator is wrapped in
`LockstepGenerator`: every call that changes the engine (`add_request`, `abort`, `load_adapter`,
`unload_adapter`) is applied on rank 0 first and, when it succeeds, queued; `step()` sends the queued commands
and "step" to the other ranks in one message, then steps. The other ranks run `follow()`: apply the commands in
the same order, step. Scheduling is deterministic and the sampled tokens are rank 0's (the generator broadcasts
them each step), so the ranks never diverge.

Messages go over a gloo group of their own (also under NCCL): pickled objects, with a timeout. While rank 0 is
idle a heartbeat keeps the followers' receive from timing out. A rank that dies closes its connections: the
next send (at most one heartbeat later) fails on rank 0, which calls `on_failure` (the server ends); a
follower whose rank 0 is gone fails its receive and exits. Any failure while the ranks may be out of step (a
step that raised) is fatal on purpose: a half-applied collective would hang the next one.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from transformers.utils import logging

from paged_hf.engine.face import MUTATING, EngineFace, EngineLimits, Preparation

logger = logging.get_logger(__name__)

#: seconds between heartbeats while rank 0 sends nothing else
HEARTBEAT_S = 1.0
#: seconds a follower waits for rank 0's next message before it gives up (many missed heartbeats)
FOLLOWER_TIMEOUT_S = 60.0



@dataclass(frozen=True)
class Mirrored:
    """One call that changed rank 0's engine (`face.MUTATING`), to be applied on every other rank in order."""
    name: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Message:
    """What rank 0 sends: the calls since the last message, then `step`, `stop` or `noop` (a heartbeat)."""
    kind: str
    calls: list


class RankFailure(RuntimeError):
    """Another rank (tensor or pipeline parallel) stopped answering (died, or the ranks left lockstep)."""


def control_group(timeout_s: float = FOLLOWER_TIMEOUT_S):
    """A gloo group over every rank for the commands (collective: every rank calls it once, in the same order)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class LockstepGenerator(EngineFace):
    """Rank 0's engine for the server: the calls that change it are mirrored on every rank; the others are its own.

    `on_failure(exc)`, public and settable after construction (the server it ends is built around this
    generator): called once, from the thread that saw another rank fail."""

    def __init__(self, generator: EngineFace, group, on_failure=None, heartbeat_s: float = HEARTBEAT_S):
        self._generator, self._group, self.on_failure = generator, group, on_failure
        self._pending: list[Mirrored] = []  # calls applied here, not yet sent (engine thread only)
        self._send_lock = threading.Lock()  # the engine thread and the heartbeat share the group
        self._last_send = time.monotonic()
        self._heartbeat_s = heartbeat_s
        self.failure: BaseException | None = None
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="paged_hf-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    # --- mirrored on every rank -------------------------------------------------------------------------------
    def add_request(self, *args, **kwargs) -> str:
        return self._mirrored("add_request", args, kwargs)

    def abort(self, request_id: str) -> None:
        if self.failure is not None:
            return self._generator.abort(request_id)  # frees its blocks here; nobody is left to mirror it
        return self._mirrored("abort", (request_id,), {})

    def load_adapter(self, name: str, path) -> None:
        return self._mirrored("load_adapter", (name, path), {})

    def unload_adapter(self, name: str) -> None:
        return self._mirrored("unload_adapter", (name,), {})

    def _mirrored(self, name: str, args: tuple, kwargs: dict):
        assert name in MUTATING
        self._check_alive()
        result = getattr(self._generator, name)(*args, **kwargs)  # raises for bad input: nothing is sent
        self._pending.append(Mirrored(name, args, kwargs))
        return result

    def step(self):
        self._check_alive()
        calls, self._pending = self._pending, []
        self._send(Message("step", calls))
        try:
            return self._generator.step()
        except BaseException as exc:
            self._fail(exc)
            raise

    # --- rank 0's own -----------------------------------------------------------------------------------------
    @property
    def limits(self) -> EngineLimits:
        return self._generator.limits

    def has_unfinished_requests(self) -> bool:
        """False once failed: nothing can run any more (a step would wait on the missing rank)."""
        return self.failure is None and self._generator.has_unfinished_requests()

    def has_started(self, request_id: str) -> bool:
        return self._generator.has_started(request_id)

    def stats(self) -> dict:
        return self._generator.stats()

    def prepare(self, sampling_params) -> Preparation | None:
        return self._generator.prepare(sampling_params)  # (the other ranks compile at submission)

    def process_prompt(self, prompt, add_special_tokens: bool | None = None):
        return self._generator.process_prompt(prompt, add_special_tokens)  # (its items travel with add_request)

    def adapter_names(self) -> list[str]:
        return self._generator.adapter_names()

    def resident_adapter_names(self) -> list[str]:
        return self._generator.resident_adapter_names()

    def kv_transfer(self):
        return self._generator.kv_transfer()

    def close(self) -> None:
        """Tell the other ranks to stop (after the server's engine is stopped). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.failure is None:
            try:
                self._send(Message("stop", self._pending))
            except RankFailure:
                pass
        self._heartbeat.join(5 * self._heartbeat_s)

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise RankFailure(f"another rank failed: {self.failure}")

    def _send(self, message) -> None:
        with self._send_lock:
            self._check_alive()
            try:
                dist.broadcast_object_list([message], src=0, group=self._group)
            except BaseException as exc:
                self._fail(exc)
                raise RankFailure(f"a rank stopped answering: {exc}") from exc
            self._last_send = time.monotonic()

    def _fail(self, exc: BaseException) -> None:
        if self.failure is not None:
            return
        self.failure = exc
        logger.error("a rank failed: %s", exc)
        if self.on_failure is not None:
            self.on_failure(exc)

    def _beat(self) -> None:
        while not self._closed.wait(self._heartbeat_s / 2):
            if self.failure is not None:
                return
            if time.monotonic() - self._last_send >= self._heartbeat_s:
                try:
                    self._send(Message("noop", []))
                except RankFailure:
                    return


def follow(generator: EngineFace, group) -> None:
    """Every rank but 0: mirror rank 0's engine until it says stop. Raises RankFailure when rank 0 is gone or a
    command fails here (the ranks could no longer agree). SIGINT/SIGTERM are ignored: rank 0 owns the lifetime
    (it drains, then tells the others to stop)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except BaseException as exc:
            raise RankFailure(f"rank 0 stopped answering: {exc}") from exc
        message: Message = box[0]
        for call in message.calls:
            getattr(generator, call.name)(*call.args, **call.kwargs)
        if message.kind == "step":
            generator.step()
        elif message.kind == "stop":
            return
