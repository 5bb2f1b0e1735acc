"""The exceptions of hybridd: one class per way a request can fail, each carrying the
daemon's stable error `code` (protocol/errors.py), the offending `field` and, when the
daemon had produced output before the failure, the `partial` result. The SDK raises
them to callers; the workers raise `EngineDeadError` when their peer stops answering.

Failing to reach the daemon at all is `unavailable` too, told apart by class: no daemon
at the endpoint (`DaemonUnreachableError`), or one that refused this client's CURVE
keys (`HandshakeRefusedError`).
"""

from __future__ import annotations

from typing import Any

from hybridd.protocol.errors import ErrorCode
from hybridd.results import GenerateResult


class HybriddError(Exception):
    """Base class: `code` is the wire error code (an unknown one reads as `internal`)."""

    default_code = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | str | None = None,
        field: str | None = None,
        request_id: str | None = None,
        partial: GenerateResult | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = ErrorCode(code) if code is not None else self.default_code
        self.field = field
        self.request_id = request_id
        self.partial = partial

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class InvalidRequestError(HybriddError):
    """The daemon (or the SDK's own check, with the same rules) refused the request as invalid."""

    default_code = ErrorCode.INVALID_REQUEST


class OverloadedError(HybriddError):
    """The daemon's queue is full; retry with backoff."""

    default_code = ErrorCode.OVERLOADED


class DrainingError(HybriddError):
    """The daemon is shutting down and takes no new requests."""

    default_code = ErrorCode.DRAINING


class UnavailableError(HybriddError):
    """The daemon cannot serve the call now: it is starting, loading or restarting its
    workers (the message says which), or it could not be reached (the subclasses)."""

    default_code = ErrorCode.UNAVAILABLE


class DaemonUnreachableError(UnavailableError, ConnectionError):
    """No daemon answered at the endpoint within the connect timeout: no socket file,
    nothing listening (a stale socket of a daemon that died), or no ZeroMQ handshake."""


class HandshakeRefusedError(DaemonUnreachableError, ConnectionRefusedError):
    """The daemon refused the CURVE handshake: this client's public key is not among its
    authorised keys, or the server key given is not the daemon's. Retrying does not help."""


class EngineDeadError(HybriddError):
    """A worker died, or the daemon's socket disconnected, while the request was in flight.

    Not sticky: the client reconnects by itself, and new calls succeed once the daemon is back.
    """

    default_code = ErrorCode.ENGINE_DEAD


class RequestTimeoutError(HybriddError, TimeoutError):
    """The call's timeout expired (on the client, or on the daemon via `timeout_s`)."""

    default_code = ErrorCode.TIMEOUT


class RequestCancelledError(HybriddError):
    """The request was cancelled (`cancel()`, or the daemon's drain deadline)."""

    default_code = ErrorCode.CANCELLED


class NotFoundError(HybriddError):
    default_code = ErrorCode.NOT_FOUND


class InternalError(HybriddError):
    """A failure inside the daemon (also a generation that ended with `finish_reason: error`)."""

    default_code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[HybriddError]] = {
    ErrorCode.MALFORMED: InvalidRequestError,
    ErrorCode.TOO_LARGE: InvalidRequestError,
    ErrorCode.UNSUPPORTED_VERSION: InvalidRequestError,
    ErrorCode.INVALID_REQUEST: InvalidRequestError,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.DRAINING: DrainingError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.ENGINE_DEAD: EngineDeadError,
    ErrorCode.TIMEOUT: RequestTimeoutError,
    ErrorCode.CANCELLED: RequestCancelledError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.INTERNAL: InternalError,
}


def error_for_code(code: ErrorCode | str, message: str, **details: Any) -> HybriddError:
    try:
        code = ErrorCode(code)
    except ValueError:
        message, code = f"[{code}] {message}", ErrorCode.INTERNAL
    return _BY_CODE[code](message, code=code, **details)
