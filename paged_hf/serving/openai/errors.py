"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure the server reports.

One exception type (`ApiError`) carries the status and the body, so handlers raise and never build responses
for errors themselves; `create_app` installs the handlers that turn it (and FastAPI's own validation and HTTP
errors) into that shape.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status_code: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


def error_body(status_code: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    error_type = _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status_code: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, code, param), status_code=status_code, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the first offending field (OpenAI's `param`)."""
    parts, param = [], None
    for error in exc.errors():
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if error.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        field = ".".join(loc)
        param = param or (field or None)
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{field}: {message}" if field else message)
    return ("; ".join(parts) or "invalid request"), param


def install_error_handlers(app, on_error) -> None:
    """`on_error(status_code)` counts every error response for /metrics."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        on_error(exc.status_code)
        headers = {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": "1"}}.get(exc.status_code)
        return error_response(exc.status_code, exc.message, exc.code, exc.param, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        on_error(400)
        message, param = validation_message(exc)
        return error_response(400, message, "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        on_error(exc.status_code)
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        on_error(500)
        return error_response(500, f"internal server error: {type(exc).__name__}", "internal_error")
