"""Call an ASGI app in-process and stream its response: how a replica runs `paged-hf serve`'s own app (API
key, validation, streaming, errors all unchanged) for a request that reached it through Ray Serve.

`call_asgi` yields the response start (`{"status", "headers"}`) and then the body's chunks as the app sends
them. When the caller stops iterating (the client left), the app sees `http.disconnect` and is cancelled, so
a streamed request is aborted in the engine as it would be behind uvicorn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class HttpCall:
    """One HTTP request as the ingress forwards it (headers as (name, value) string pairs)."""

    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "root_path": "", "query_string": self.query.encode("latin-1"),
                "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers],
                "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {}}


async def call_asgi(app, call: HttpCall):
    """Run `app` on `call`: yields {"status", "headers"} once, then each body chunk (bytes)."""
    messages: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await messages.put(message)

    task = asyncio.ensure_future(app(call.scope(), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or raised) without finishing its response
                task.result()
                return
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # the response is complete: let the app finish (its own cleanup included)
    finally:
        left.set()  # the caller left early: the app sees the client go, then is cancelled
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
