"""Errors in OpenAI's format, and which HTTP status each daemon error code gets.

The body is `{"error": {"message", "type", "param", "code"}}`, as OpenAI sends it,
on every route (unknown routes too); `code` is always a stable string that a client
can branch on. The `openai` client libraries turn the status into their exception
classes (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 413, 429
RateLimitError, 5xx InternalServerError); 429 and 503 say when to retry
(`Retry-After`).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from hybridd.errors import HybriddError
from hybridd.protocol.errors import ErrorCode

# (HTTP status, OpenAI error type) per daemon error code.
STATUS_BY_CODE: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.MALFORMED: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.UNSUPPORTED_VERSION: (400, "invalid_request_error"),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "not_found_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.DRAINING: (503, "service_unavailable_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.ENGINE_DEAD: (503, "service_unavailable_error"),
    ErrorCode.TIMEOUT: (504, "timeout_error"),
    ErrorCode.CANCELLED: (500, "internal_error"),
    ErrorCode.INTERNAL: (500, "internal_error"),
}

# The error code of an error the gateway finds itself, by HTTP status, where the error
# names none more precise.
CODE_BY_STATUS: dict[int, str] = {
    400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
    413: "request_too_large", 429: "overloaded", 500: "internal", 503: "unavailable", 504: "timeout",
}
# Seconds a client should wait before it tries again: an overloaded queue drains within
# steps; a daemon that is starting or restarting takes longer.
RETRY_AFTER_S = {429: 1, 503: 5}


class GatewayError(Exception):
    """A request the gateway answers with an error; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, state: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code or CODE_BY_STATUS.get(status, "error")
        self.state = state

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.state is not None:
            error["state"] = self.state
        return {"error": error}

    def headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """The response's own headers (raw ASGI)."""
        if self.status == 401:
            return ((b"www-authenticate", b"Bearer"),)
        if (retry := RETRY_AFTER_S.get(self.status)) is not None:
            return ((b"retry-after", b"%d" % retry),)
        return ()

    def response(self) -> JSONResponse:
        headers = {k.decode(): v.decode() for k, v in self.headers()}
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def not_ready(state: str) -> GatewayError:
    return GatewayError(503, f"the daemon is not ready (state: {state})", type="service_unavailable_error",
                        code=state, state=state)


def from_daemon(error: HybriddError, structured_param: str | None = None) -> GatewayError:
    """The HTTP error for an SDK exception; the daemon's field path becomes OpenAI's `param`
    (a structured output's, the body field that asked for it: `structured_param`)."""
    status, kind = STATUS_BY_CODE.get(error.code, (500, "internal_error"))
    param = error.field.removeprefix("sampling.") if error.field else None
    if param == "prompt_token_ids":
        param = "prompt"
    message = error.message.removeprefix("sampling.")
    if param is not None and param.startswith("structured") and structured_param is not None:
        message = f"{structured_param}: {message.partition(': ')[2] or message}"
        param = structured_param
    return GatewayError(status, message, type=kind, param=param, code=error.code.value)


def from_http(status: int, detail: str, path: str) -> GatewayError:
    """The error for what the router answers itself (no such route, a method not allowed)."""
    if status == 404:
        return GatewayError(404, f"no route {path}", type="not_found_error", code="not_found")
    if status == 405:
        return GatewayError(405, f"{detail} on {path}", code="method_not_allowed")
    return GatewayError(status, detail)
