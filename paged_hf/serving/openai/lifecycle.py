"""A request's and the server's lifetime: streams that abort their request whenever they end early, and a
uvicorn server that drains on SIGTERM.

Why a response class: a streamed request's outputs are read by an async generator that only starts when the
response starts sending; a client that leaves before that (or a send that fails) would leave the request
running to the end, with nobody reading it. The response itself aborts it when it ends, however it ends (a
no-op for a request that finished).

Why a server class: uvicorn, on SIGTERM, waits for every open connection, and a stream may run for minutes;
a second SIGTERM is ignored (only a second SIGINT forces it). Here the first signal starts a drain: no new
request, the running ones get `grace_s` seconds, then the engine aborts what is left and each request gets its
last output with finish_reason "abort" (queued ones included), so every connection ends and uvicorn exits. A
second signal exits at once.
"""

from __future__ import annotations

import os
import sys

import uvicorn
from fastapi.responses import StreamingResponse
from transformers.utils import logging

logger = logging.get_logger(__name__)


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its engine requests when it ends, however it ends (`request_ids`: one id,
    or one per prompt of a batched completion)."""

    def __init__(self, content, engine, request_ids: str | list[str], **kwargs):
        super().__init__(content, **kwargs)
        self.engine = engine
        self.request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for request_id in self.request_ids:
                self.engine.abort(request_id)  # a no-op once the request finished


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, with SIGTERM/SIGINT: first a drain of at most `grace_s` seconds, then exit; a second
    signal: exit at once."""

    def __init__(self, config: uvicorn.Config, engine, grace_s: float):
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s
        self.config.timeout_graceful_shutdown = grace_s + 10  # a last resort for connections that never end

    def handle_exit(self, sig: int, frame) -> None:
        if self.engine.draining:
            print("paged-hf serve: second signal, exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        print(f"paged-hf serve: draining for at most {self.grace_s:g} s (send the signal again to exit now)",
              file=sys.stderr, flush=True)
        self.engine.drain(self.grace_s)
        super().handle_exit(sig, frame)
