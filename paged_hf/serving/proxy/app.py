"""The proxy's routes: completions and chat through a prefill instance then a decode instance (or straight to
decode), /v1/models and /health asked of decode instances, and the proxy's own /metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from paged_hf.serving.proxy.metrics import ProxyMetrics
from paged_hf.serving.proxy.routing import ProxySettings, Router, prefill_body
from paged_hf.serving.proxy.upstream import ProxyError, Upstreams

#: seconds a decode instance has to answer the proxy's /health
HEALTH_TIMEOUT_S = 5.0


def create_proxy_app(settings: ProxySettings) -> FastAPI:
    router, metrics, upstreams = Router(settings), ProxyMetrics(), Upstreams(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await upstreams.aclose()

    app = FastAPI(title="paged_hf proxy", lifespan=lifespan)

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError):
        return exc.response()

    keyed = [Depends(_key_check(settings.api_key))]

    async def generate(request: Request) -> Response:
        return await _disaggregate(request, router, upstreams, metrics)

    for route in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(route, generate, methods=["POST"], dependencies=keyed)

    @app.get("/v1/models", dependencies=keyed)
    async def models(request: Request):
        return await upstreams.get(router.decodes.pick(), "/v1/models", _forwarded(request))

    @app.get("/metrics", dependencies=keyed)
    async def metrics_route():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health():
        """Healthy while at least one decode instance is: a decode instance alone can answer every request."""
        answers = await asyncio.gather(*(upstreams.get(url, "/health", {}, HEALTH_TIMEOUT_S)
                                         for url in settings.decode_urls), return_exceptions=True)
        if any(isinstance(answer, Response) and answer.status_code == 200 for answer in answers):
            return {"status": "ok"}
        return ProxyError(503, "no decode instance is healthy", "decode_unavailable").response()

    return app


async def _disaggregate(request: Request, router: Router, upstreams: Upstreams, metrics: ProxyMetrics) -> Response:
    """Plan the request's path, run the prefill when it has one, and relay decode's answer."""
    body = await _json_body(request, router.settings.max_body_bytes)
    route, headers = request.url.path, _forwarded(request)
    body.pop("kv_transfer_params", None)  # between the proxy and its instances only: never a client's

    async def count_tokens(decode_url: str, tokenize: dict) -> int | None:
        return await upstreams.count_tokens(decode_url, tokenize, headers)

    plan = await router.plan(route, body, headers.get("Authorization"), count_tokens)
    metrics.requests[plan.path] += 1
    if plan.prefill_url is not None:
        chat = route.endswith("/chat/completions")
        outcome = await upstreams.prefill(plan.prefill_url, route, prefill_body(body, chat), headers)
        if outcome.client_error is not None:
            return outcome.client_error
        if outcome.failed:
            metrics.prefill_failures += 1
            if router.settings.on_prefill_failure == "fail":
                raise ProxyError(503, "the prefill of this request failed", "prefill_unavailable")
            metrics.fallbacks += 1  # recompute: decode gets the request alone
        elif outcome.params is not None:
            metrics.count_transfer(outcome.params)
            body["kv_transfer_params"] = outcome.params
    response = await upstreams.relay(plan.decode_url, route, body, headers)
    if plan.prefill_url is not None and response.status_code == 200:
        router.remember(plan)
    return response


async def _json_body(request: Request, max_bytes: int) -> dict:
    """The request's JSON object, read no further than `max_bytes` (the proxy holds it whole)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise ProxyError(413, f"the request body is larger than {max_bytes} bytes", "invalid_request_error")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ProxyError(400, "the request body is not valid JSON", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body must be a JSON object", "invalid_request_error")
    return body


def _forwarded(request: Request) -> dict:
    """The client's headers the instances get: its API key (all instances share the keys)."""
    authorization = request.headers.get("authorization")
    return {} if authorization is None else {"Authorization": authorization}


def _key_check(api_key: str | None):
    """A dependency: with `api_key` set, a request without `Authorization: Bearer <api_key>` is a 401."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
            raise ProxyError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'",
                             "authentication_error")

    return check

