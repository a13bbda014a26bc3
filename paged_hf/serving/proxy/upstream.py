"""The proxy's calls to its instances, over one shared httpx client: a token count, a prefill, and a decode
answer relayed to the client as it comes (a stream chunk by chunk, never buffered whole)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers.utils import logging

from paged_hf.serving.proxy.routing import ProxySettings

logger = logging.get_logger(__name__)


class ProxyError(Exception):
    """An answer of the proxy's own, as OpenAI's error JSON: {"error": {"message", "type", "code"}}."""

    def __init__(self, status_code: int, message: str, error_type: str):
        super().__init__(message)
        self.status_code, self.message, self.error_type = status_code, message, error_type

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.error_type, "param": None, "code": self.status_code}}
        return JSONResponse(body, status_code=self.status_code)


@dataclass
class PrefillOutcome:
    """`failed`: no usable answer (no connection, a timeout, a 5xx, a 200 without JSON). `client_error`: the
    prefill's 4xx, for the client as it is (its request is wrong, decode would say the same). `params`: the
    kv_transfer_params the prefill answered (None: it transferred nothing)."""

    failed: bool = False
    client_error: Response | None = None
    params: dict | None = None


class RelayedStream(StreamingResponse):
    """An upstream's stream passed through; the upstream response is closed however the client's ends, so a
    client that goes away aborts the decode instance's request too."""

    def __init__(self, upstream: httpx.Response):
        super().__init__(upstream.aiter_bytes(), status_code=upstream.status_code,
                         media_type=upstream.headers.get("content-type"))
        self.upstream = upstream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()


class Upstreams:
    """The HTTP side of the proxy. Instances are called directly: proxy settings in the environment
    (HTTP_PROXY) are not applied to them."""

    def __init__(self, settings: ProxySettings):
        timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, trust_env=False,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def count_tokens(self, decode_url: str, body: dict, headers: dict) -> int | None:
        """The prompt's token count from `decode_url`'s /tokenize; None if it gives none (the prompt then
        counts as long). An instance that refuses the connection is down: a 503 at once."""
        try:
            response = await self.client.post(decode_url + "/tokenize", json=body, headers=headers)
        except httpx.ConnectError as exc:
            raise _unavailable("decode", decode_url, exc) from exc
        except httpx.HTTPError:
            return None
        count = _json(response).get("count") if response.status_code == 200 else None
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    async def prefill(self, url: str, route: str, body: dict, headers: dict) -> PrefillOutcome:
        try:
            response = await self.client.post(url + route, json=body, headers=headers)
        except httpx.HTTPError as exc:
            logger.warning(f"proxy: the prefill instance {url} did not answer: {type(exc).__name__}: {exc}")
            return PrefillOutcome(failed=True)
        if 400 <= response.status_code < 500:
            return PrefillOutcome(client_error=_relayed(response))
        answer = _json(response)
        if response.status_code != 200 or not answer:
            logger.warning(f"proxy: the prefill instance {url} answered {response.status_code} without usable JSON")
            return PrefillOutcome(failed=True)
        params = answer.get("kv_transfer_params")
        return PrefillOutcome(params=params if isinstance(params, dict) else None)

    async def relay(self, url: str, route: str, body: dict, headers: dict) -> Response:
        """`body` sent to `url`, its answer back as it is: a stream (`stream: true`) passed through."""
        try:
            if body.get("stream") is not True:
                return _relayed(await self.client.post(url + route, json=body, headers=headers))
            request = self.client.build_request("POST", url + route, json=body, headers=headers)
            response = await self.client.send(request, stream=True)
            if response.status_code != 200:  # an error answer is JSON, short: read whole
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                return _relayed(response)
        except httpx.HTTPError as exc:
            raise _unavailable("decode", url, exc) from exc
        return RelayedStream(response)

    async def get(self, url: str, path: str, headers: dict, timeout=httpx.USE_CLIENT_DEFAULT) -> Response:
        try:
            response = await self.client.get(url + path, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise _unavailable("decode", url, exc) from exc
        return _relayed(response)

    async def aclose(self) -> None:
        await self.client.aclose()


def _json(response: httpx.Response) -> dict:
    try:
        answer = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return answer if isinstance(answer, dict) else {}


def _relayed(response: httpx.Response) -> Response:
    return Response(response.content, status_code=response.status_code,
                    media_type=response.headers.get("content-type"))


def _unavailable(role: str, url: str, exc: Exception) -> ProxyError:
    """The instance's address goes to the log, not to the client."""
    logger.warning(f"proxy: the {role} instance {url} did not answer: {type(exc).__name__}: {exc}")
    return ProxyError(503, f"a {role} instance did not answer ({type(exc).__name__})", f"{role}_unavailable")
