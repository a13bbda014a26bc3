"""The FastAPI app: `create_app(generator, tokenizer, model_name, settings)`.

A factory (not a module-level app) so tests build it around a tiny model and the CLI around a real one. The
app starts the engine thread on startup and stops it (aborting what is left) on shutdown; handlers only talk
to that thread (see engine_loop.py).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_hf.serving.openai.api_keys import key_name
from paged_hf.serving.openai.completions import completion_choices, last_output, merged, prompt_logprob_entries
from paged_hf.serving.openai.embeddings import add_embeddings_route
from paged_hf.serving.openai.engine_loop import EngineError, EngineLoop
from paged_hf.serving.openai.errors import ApiError, error_body, error_response, install_error_handlers
from paged_hf.serving.openai.extra_routes import add_extra_routes
from paged_hf.serving.openai.kv_transfer import KVTransfer, add_kv_transfer_routes
from paged_hf.serving.openai.lifecycle import AbortingStreamingResponse
from paged_hf.serving.openai.logprobs import Deltas, chat_logprobs, completion_logprobs
from paged_hf.serving.openai.memory import LARGE_BODY_BYTES, freeze_startup_objects
from paged_hf.serving.openai.messages import add_messages_routes
from paged_hf.serving.openai.metrics import MetricsView, ServerMetrics
from paged_hf.serving.openai.prep_threads import install_prep_executor
from paged_hf.serving.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from paged_hf.serving.openai.reasoning import request_outputs
from paged_hf.serving.openai.request_body import read_body
from paged_hf.serving.openai.responses import add_responses_routes
from paged_hf.serving.openai.server_settings import ServerSettings
from paged_hf.serving.openai.serving import (
    Prepared,
    ServerContext,
    outputs,
    prepare_off_loop,
    request_key_name,
    submit,
    usage,
)
from paged_hf.serving.openai.tenancy import owner_of
from paged_hf.serving.openai.tool_calls import ToolCallStreamer, finish_reason, parse_output, parser_for
from paged_hf.serving.openai.vllm_metrics import vllm_aliases
from paged_hf.utils import trim_heap


class GuardMiddleware:
    """API key and body size, in plain ASGI: checked before a handler runs, and without wrapping responses
    (Starlette's BaseHTTPMiddleware would buffer streams and hide client disconnects). After a large request or
    answer body the freed heap goes back to the system (memory.py)."""

    OPEN_PATHS = ("/health", "/ping")

    def __init__(self, app, settings: ServerSettings, metrics: ServerMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        rejection = guard_rejection(self.settings, scope["path"], headers)
        if rejection is not None:
            self.metrics.count_error(rejection.status_code)
            return await rejection(scope, receive, send)
        if self.settings.named_keys:  # the handlers' tenant (request.state.api_key_name)
            scope.setdefault("state", {})["api_key_name"] = key_name(self.settings.named_keys, headers)
        limit, received = self.settings.max_body_bytes, 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body without Content-Length
                    raise StarletteHTTPException(413, f"the request body is larger than {limit} bytes")
            return message

        sent = 0

        async def counted_send(message):
            nonlocal sent
            if message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, limited_receive, counted_send)
        finally:
            if max(received, sent) >= LARGE_BODY_BYTES:  # answered or refused: what it took is garbage now
                await asyncio.to_thread(trim_heap)


def guard_rejection(settings: ServerSettings, path: str, headers: dict) -> JSONResponse | None:
    """The answer to a request without one of the API keys (401; `Authorization: Bearer` or Anthropic's
    `x-api-key`) or with a body over the limit (413), else None. `headers`: lower-cased names. Also asked by
    the Ray ingress, which tokenizes only what would pass."""
    if settings.named_keys and path not in GuardMiddleware.OPEN_PATHS:
        if key_name(settings.named_keys, headers) is None:
            return error_response(401, "Missing or invalid API key: send 'Authorization: Bearer <key>' (or "
                                  "'x-api-key: <key>')", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
        return error_response(413, f"the request body is larger than {settings.max_body_bytes} bytes",
                              "request_too_large")
    return None


def create_app(generator, tokenizer, model_name: str | list[str], settings: ServerSettings | None = None) -> FastAPI:
    """`model_name`: the base model's served name, or several (all accepted, the first reported by default).
    `tokenizer`: the model's tokenizer, or a vision-language model's processor (its images: chat_images.py)."""
    settings = settings or ServerSettings()
    processor = tokenizer if hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer") else None
    tokenizer = processor.tokenizer if processor is not None else tokenizer
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    metrics = ServerMetrics()
    engine = EngineLoop(generator, metrics, settings.max_queue, settings.engine_threads)
    # (the limit fits the whole KV cache too: default max_tokens never asks for more than that holds)
    ctx = ServerContext(engine, tokenizer, names[0], settings, engine.limits.max_model_len, metrics, tuple(names),
                        processor=processor)
    transfer = generator.kv_transfer()
    if transfer is not None:
        ctx.kv_transfer = KVTransfer(*transfer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        freeze_startup_objects()
        install_prep_executor(asyncio.get_running_loop())  # asyncio.to_thread's threads yield the CPU to the engine
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            gc.unfreeze()  # the process goes on (a test, an embedding program): collect as usual again

    app = FastAPI(title="paged_hf", lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics)
    if settings.cors_origins:  # outside the guard: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    install_error_handlers(app, metrics.count_error)
    _add_routes(app, ctx)
    add_extra_routes(app, ctx)
    add_embeddings_route(app, ctx)
    add_responses_routes(app, ctx)
    add_messages_routes(app, ctx)
    add_kv_transfer_routes(app, ctx)
    return app


def _add_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_route(http_request: Request):
        text = ctx.metrics.render(ctx.engine.stats, ctx.engine.num_in_flight, metrics_view(ctx, http_request))
        text += ctx.kv_transfer.render() if ctx.kv_transfer is not None else ""
        return PlainTextResponse(text + vllm_aliases(text, ctx.model_name), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(http_request: Request):
        owner = owner_of(ctx.settings, request_key_name(http_request))
        length = ctx.max_model_len
        cards = [ModelCard(id=name, root=ctx.model_name, max_model_len=length) for name in ctx.served_names]
        cards += [ModelCard(id=name, root=name, parent=ctx.model_name, max_model_len=length)
                  for name in ctx.adapters_seen_by(owner)]
        return ModelList(data=cards)

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        body = await read_body(http_request, CompletionRequest, ctx.settings, ("prompt",))
        return await _serve(ctx, body, http_request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        body = await read_body(http_request, ChatCompletionRequest, ctx.settings, ("messages", "tools"))
        return await _serve(ctx, body, http_request, chat=True)


def metrics_view(ctx: ServerContext, http_request: Request) -> MetricsView:
    """With tenants (tenancy.py), a key sees its own requests' per-tenant series and not the adapters other keys
    loaded; a key named by --metrics-key (a scraper's) and a server without tenants see everything."""
    key = request_key_name(http_request)
    if not ctx.settings.tenant_isolation or key in ctx.settings.metrics_keys:
        return MetricsView()
    hidden = frozenset(name for name in ctx.adapter_owners.owned if not ctx.adapter_owners.visible(name, key))
    return MetricsView(owner=key, hidden_adapters=hidden)


async def _serve(ctx: ServerContext, body, http_request: Request, chat: bool):
    prepared = await prepare_off_loop(ctx, body, chat, time.monotonic(), http_request)
    if ctx.kv_transfer is not None and body.kv_transfer_params:
        await receive_blocks(ctx, prepared, body.kv_transfer_params, http_request)
    streams = await submit(ctx, prepared, reserved=True)  # bad input fails here, before any streamed byte
    sources = [outputs(ctx, http_request, stream, prepared.stream) for stream in streams]
    if prepared.stream:
        events = (_chat_events(ctx, prepared, sources[0]) if chat else
                  _completion_events(ctx, prepared, merged(sources)))
        return AbortingStreamingResponse(_sse(events), ctx.engine, [stream.request_id for stream in streams],
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        finals = await asyncio.gather(*(last_output(source) for source in sources))
    except EngineError as exc:
        raise ApiError(500, str(exc), "engine_error") from None
    if any(final is None for final in finals):  # the client went away; nobody reads this
        raise ApiError(499, "client disconnected", "client_disconnected")
    transfer = None
    if ctx.kv_transfer is not None and len(finals) == 1:
        transfer = await ctx.kv_transfer.answer_params(finals[0], http_request)
    return await asyncio.to_thread(_json_answer, ctx, prepared, finals, chat, transfer)


async def receive_blocks(ctx: ServerContext, prepared: Prepared, params: dict, http_request: Request) -> None:
    """A KV consumer's transfer, after the request took its queue slot (given back if the params are bad)."""
    try:
        await ctx.kv_transfer.receive(params, http_request, ctx.max_model_len // ctx.kv_transfer.block_size + 1)
    except BaseException:
        ctx.engine.release()
        raise


def _json_answer(ctx: ServerContext, prepared: Prepared, finals: list, chat: bool, transfer: dict | None) -> Response:
    """The whole answer, built and serialized in a worker thread: with logprobs it decodes every token and can
    be megabytes of JSON, which on the event loop would stall every stream and /health."""
    if chat:
        answer = _chat_response(ctx, prepared, finals[0])
    else:
        answer = CompletionResponse(id=prepared.request_id, model=prepared.model,
                                    choices=completion_choices(ctx, prepared, finals), usage=usage(prepared, *finals))
    answer.kv_transfer_params = transfer
    return Response(answer.model_dump_json(), media_type="application/json")


def _chat_response(ctx: ServerContext, prepared: Prepared, output) -> ChatCompletionResponse:
    k = prepared.params.logprobs
    parser = parser_for(ctx.settings.tool_call_parser)
    thinking = request_outputs(prepared, ctx.tokenizer)
    choices = []
    for c in output.outputs:
        reasoning, answer = thinking.split(c) if thinking is not None else (None, c)
        content, calls = parse_output(prepared.tools, parser, ctx.tokenizer, answer)
        if thinking is not None:  # (all thinking: no content, as vLLM's)
            content, reasoning = content or None, reasoning if prepared.include_reasoning else None
        choices.append(ChatChoice(
            index=c.index, message=ChatMessageOut(content=content, reasoning=reasoning, reasoning_content=reasoning,
                                                  tool_calls=calls or None),
            finish_reason=finish_reason(c, calls), stop_reason=c.stop_reason,
            logprobs=None if k is None else chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs or [], k)))
    return ChatCompletionResponse(id=prepared.request_id, model=prepared.model, choices=choices,
                                  usage=usage(prepared, output, thinking=thinking),
                                  prompt_logprobs=prompt_logprob_entries(ctx.tokenizer, output.prompt_logprobs))


async def _sse(events):
    """Server-sent events: one `data: {json}` per chunk, an error event if the engine fails, then [DONE]."""
    try:
        async for chunk in events:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except EngineError as exc:
        yield f"data: {json.dumps(error_body(500, str(exc), 'engine_error'))}\n\n"
    yield "data: [DONE]\n\n"


async def _completion_events(ctx: ServerContext, prepared: Prepared, source):
    """source: (prompt index, output) pairs of every prompt (completions.merged); choice i * n + j."""
    n, k = prepared.params.n, prepared.params.logprobs
    deltas = [Deltas() for _ in prepared.prompts]
    offsets: dict[int, int] = {}  # text_offset of each sequence's next token: its tokens' texts so far, as unstreamed
    last = {}
    async for i, output in source:
        last[i] = output
        choices = []
        for c, text, token_ids, entries in deltas[i].new_pieces(output):
            index, logprobs = i * n + c.index, None
            if k is not None:
                logprobs = completion_logprobs(ctx.tokenizer, token_ids, entries, k, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(token) for token in logprobs.tokens)
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
        if choices:
            yield CompletionResponse(id=prepared.request_id, model=prepared.model, choices=choices)
    if prepared.include_usage and last:
        yield CompletionResponse(id=prepared.request_id, model=prepared.model, choices=[],
                                 usage=usage(prepared, *last.values()))


async def _chat_events(ctx: ServerContext, prepared: Prepared, source):
    deltas, k = Deltas(), prepared.params.logprobs

    def chunk(choices, **extra):
        return ChatCompletionChunk(id=prepared.request_id, model=prepared.model, choices=choices, **extra)

    yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                 for i in range(prepared.params.n)])
    tools = None
    if prepared.tools.kind != "none":
        tools = ToolCallStreamer(prepared.tools, parser_for(ctx.settings.tool_call_parser), ctx.tokenizer)
    thinking = request_outputs(prepared, ctx.tokenizer)
    output = None
    async for output in source:
        choices = []
        for c, text, token_ids, entries in deltas.new_pieces(output):
            logprobs = None if k is None else chat_logprobs(ctx.tokenizer, token_ids, entries, k)
            reasoning, content, answer, calls, finish = None, text, c, None, c.finish_reason
            if thinking is not None:
                reasoning, content, answer = thinking.delta(c, text)
                reasoning = reasoning if prepared.include_reasoning else None
            if tools is not None:
                content, calls, finish = tools.delta(answer, content or "")
            if not (reasoning or content or calls or finish or logprobs):  # (a marker held back)
                continue
            delta = ChatDelta(content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=calls)
            choices.append(ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                           stop_reason=c.stop_reason))
        if choices:
            yield chunk(choices)
    if prepared.include_usage and output is not None:
        yield chunk([], usage=usage(prepared, output, thinking=thinking))
