"""`Ingress`: the HTTP front of the replicas. It reads each request, works out its routing hint (the prompt's
first full blocks' hashes, tokenized as the engine will; the adapter it names) and forwards it to an engine
replica through a handle whose router (router.py) picks the replica. The response (status, headers, body, a
stream included) comes back unchanged, with an `x-paged-hf-replica` header naming who answered.

Routes that concern every replica fan out: `/metrics` (one exposition, each sample labelled with its
replica), `/v1/models` (the union), `/v1/unload_lora_adapter` (every replica that has it). A runtime
`/v1/load_lora_adapter` loads on one replica, and later requests for that adapter go there.
"""

# no `from __future__ import annotations`: FastAPI must see the route parameters' real types (Request)

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from transformers import AutoTokenizer

from paged_hf.serving.openai.app import ServerSettings, guard_rejection
from paged_hf.serving.ray.asgi import HttpCall
from paged_hf.serving.ray.exposition import merge_expositions
from paged_hf.serving.ray.routing import RoutingHint, routing_hint

REPLICA_HEADER = "x-paged-hf-replica"
_DROPPED_HEADERS = ("content-length", "transfer-encoding", "connection")

app = FastAPI(title="paged_hf replicas")


async def _relay(stream):
    try:
        async for chunk in stream:
            yield chunk
    finally:
        stream.cancel()  # the client left (a no-op once the stream ended): the replica aborts the request


def _router(deployment_name: str):
    """This process's router of the engine deployment (made with the first request through the handle). Looked
    up at call time: Ray pickles the ingress's routes, so a module global read here could be a stale copy."""
    from paged_hf.serving.ray.router import ROUTERS  # noqa: PLC0415 - the live module's, at call time (see above)

    return ROUTERS.get(deployment_name)


def _lora_name(body: bytes) -> str:
    try:
        return str(json.loads(body)["lora_name"])
    except Exception:  # noqa: BLE001
        return ""


@serve.ingress(app)  # at import, so that every process that imports this module has the same routes
class Ingress:
    def __init__(self, engine, deployment_name: str, tokenizer_path: str, served_names: list[str],
                 block_size: int, chat_template: str | None = None, tool_call_parser: str = "hermes",
                 guard: ServerSettings | None = None):
        self.engine, self.deployment_name = engine, deployment_name
        self._handle = engine.options(stream=True).handle  # made once: options() builds new handle objects
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.served_names, self.block_size, self.chat_template = set(served_names), block_size, chat_template
        self.tool_call_parser = tool_call_parser
        self.guard = guard or ServerSettings()  # the replicas' API key, body limit and template trust

    # --- forwarding ---------------------------------------------------------------------------------
    async def forward(self, request: Request, hint: RoutingHint | None = None) -> Response:
        call = HttpCall(request.method, request.url.path, request.url.query, tuple(request.headers.items()),
                        await request.body())
        if hint is None:  # a request the replica will refuse is not worth tokenizing
            hint = (await asyncio.to_thread(self.hint_for, request.url.path, call.body)
                    if self.passes_guard(request, call.body) else RoutingHint())
        stream = self._handle.remote(call, routing=hint)
        start = await stream.__anext__()
        headers = {k: v for k, v in start["headers"] if k.lower() not in _DROPPED_HEADERS}
        headers[REPLICA_HEADER] = start["replica"]
        if not headers.get("content-type", "").startswith("text/event-stream"):
            body = b"".join([chunk async for chunk in stream])
            return Response(body, status_code=start["status"], headers=headers)
        return StreamingResponse(_relay(stream), status_code=start["status"], headers=headers)

    async def everywhere(self, request: Request, replicas: list[str] | None = None) -> dict[str, Response]:
        """The request sent to each replica (all, or `replicas`): replica name -> its response."""
        names = replicas if replicas is not None else self.replica_names()
        # one after the other: calls made while handling one HTTP request share Ray's internal request id,
        # and the router would hand one call's replica to the other
        responses = [await self.forward(request, RoutingHint(replica=name)) for name in names]
        return {response.headers[REPLICA_HEADER]: response for response in responses}

    def replica_names(self) -> list[str]:
        router = _router(self.deployment_name)
        names = router.replica_names() if router is not None else []
        return names or [""]  # before the router knows any replica: one request, to whichever

    def passes_guard(self, request: Request, body: bytes) -> bool:
        """Whether the replica will take the request (API key, body size): only then is its prompt worth
        tokenizing for a routing hint; the replica answers the others (401, 413) as it would anyway."""
        headers = {name.lower(): value for name, value in request.headers.items()}
        return (guard_rejection(self.guard, request.url.path, headers) is None
                and len(body) <= self.guard.max_body_bytes)

    def hint_for(self, path: str, body: bytes) -> RoutingHint:
        return routing_hint(path, body, self.tokenizer, self.served_names, self.block_size, self.chat_template,
                            self.tool_call_parser, self.guard.trust_request_chat_template)

    def note_adapter(self, replica: str, adapter: str, loaded: bool) -> None:
        router = _router(self.deployment_name)
        if router is not None:
            router.note_adapter(replica, adapter, loaded)

    # --- routes (Ray Serve's class-based FastAPI ingress) ------------------------------------------
    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self, request: Request):
        responses = await self.everywhere(request)
        failed = [r for r in responses.values() if r.status_code != 200]
        if failed:
            return failed[0]
        text = merge_expositions({name: r.body.decode() for name, r in responses.items()})
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(self, request: Request):
        responses = await self.everywhere(request)
        cards: dict[str, dict] = {}
        for response in responses.values():
            if response.status_code != 200:
                return response
            for card in json.loads(response.body)["data"]:
                cards.setdefault(card["id"], card)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request):
        response = await self.forward(request, RoutingHint())
        if response.status_code == 200:
            self.note_adapter(response.headers[REPLICA_HEADER], _lora_name(await request.body()), True)
        return response

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request):
        responses = await self.everywhere(request)
        name = _lora_name(await request.body())
        for replica, response in responses.items():
            if response.status_code == 200:
                self.note_adapter(replica, name, False)
        ok = [r for r in responses.values() if r.status_code == 200]
        return ok[0] if ok else next(iter(responses.values()))

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    async def anything(self, request: Request, path: str):
        return await self.forward(request)
