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


_BY_CODE: dict[ErrorCode, type[HybriddError]] = {}


class HybriddError(Exception):
    """Base class: `code` is the wire error code (an unknown one reads as `internal`).

    A subclass names the code it stands for (`code=`, its default) and any other codes
    that read as it (`also=`); `error_for_code` picks the class by code."""

    default_code = ErrorCode.INTERNAL

    def __init_subclass__(cls, code: ErrorCode | None = None, also: tuple[ErrorCode, ...] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.default_code = code
            for each in (code, *also):
                _BY_CODE[each] = cls

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


class InvalidRequestError(HybriddError, code=ErrorCode.INVALID_REQUEST,
                          also=(ErrorCode.MALFORMED, ErrorCode.TOO_LARGE, ErrorCode.UNSUPPORTED_VERSION)):
    """The daemon (or the SDK's own check, with the same rules) refused the request as invalid."""


class OverloadedError(HybriddError, code=ErrorCode.OVERLOADED):
    """The daemon's queue is full; retry with backoff."""


class DrainingError(HybriddError, code=ErrorCode.DRAINING):
    """The daemon is shutting down and takes no new requests."""


class UnavailableError(HybriddError, code=ErrorCode.UNAVAILABLE):
    """The daemon cannot serve the call now: it is starting, loading or restarting its
    workers (the message says which), or it could not be reached (the subclasses)."""


class DaemonUnreachableError(UnavailableError, ConnectionError):
    """No daemon answered at the endpoint within the connect timeout: no socket file,
    nothing listening (a stale socket of a daemon that died), or no ZeroMQ handshake."""


class HandshakeRefusedError(DaemonUnreachableError, ConnectionRefusedError):
    """The daemon refused the CURVE handshake: this client's public key is not among its
    authorised keys, or the server key given is not the daemon's. Retrying does not help."""


class EngineDeadError(HybriddError, code=ErrorCode.ENGINE_DEAD):
    """A worker died, or the daemon's socket disconnected, while the request was in flight.

    Not sticky: the client reconnects by itself, and new calls succeed once the daemon is back.
    """


class RequestTimeoutError(HybriddError, TimeoutError, code=ErrorCode.TIMEOUT):
    """The call's timeout expired (on the client, or on the daemon via `timeout_s`)."""


class RequestCancelledError(HybriddError, code=ErrorCode.CANCELLED):
    """The request was cancelled (`cancel()`, or the daemon's drain deadline)."""


class NotFoundError(HybriddError, code=ErrorCode.NOT_FOUND):
    """The daemon knows no such request."""


class InternalError(HybriddError, code=ErrorCode.INTERNAL):
    """A failure inside the daemon (also a generation that ended with `finish_reason: error`)."""


def error_for_code(code: ErrorCode | str, message: str, **details: Any) -> HybriddError:
    try:
        code = ErrorCode(code)
    except ValueError:
        message, code = f"[{code}] {message}", ErrorCode.INTERNAL
    return _BY_CODE[code](message, code=code, **details)
