"""Error codes of the wire protocol and the exception that carries one.

The `ErrorCode` values are stable wire strings: clients switch on them, so a value is
never renamed or reused, only added (with a protocol version bump).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    MALFORMED = "malformed"
    """The frame is not one decodable msgpack value, or the value is not a map."""
    TOO_LARGE = "too_large"
    """The message, or one string/list inside it, exceeds a size limit."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """`v` is an integer but not a protocol version this daemon speaks."""
    INVALID_REQUEST = "invalid_request"
    """Wrong type, unknown field, missing field, value out of range, unknown `type`."""
    OVERLOADED = "overloaded"
    """Admission refused: the waiting queue is full. Retry later."""
    DRAINING = "draining"
    """The daemon is shutting down and accepts no new work."""
    UNAVAILABLE = "unavailable"
    """The daemon is not ready to serve (starting, loading, restarting its workers); in
    client libraries also: no daemon could be reached at the endpoint."""
    ENGINE_DEAD = "engine_dead"
    """A worker process died; every in-flight request receives this."""
    TIMEOUT = "timeout"
    """An internal deadline expired (or, in client libraries, the client's own)."""
    CANCELLED = "cancelled"
    """The request was cancelled before the daemon could produce a `final`."""
    NOT_FOUND = "not_found"
    """The object named by the request does not exist."""
    INTERNAL = "internal"
    """A bug or unexpected failure inside the daemon."""


class ProtocolError(Exception):
    """A message violates the protocol; `code` says how, `field` names where.

    `request_id` is set once the offending message's `id` is known, so that the
    error reply can be attributed to the right request.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        field: str | None = None,
        request_id: str | None = None,
        version: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.field = field
        self.request_id = request_id
        self.version = version  # the version to answer in, when the message's own is known

    def __str__(self) -> str:
        where = f" (field {self.field!r})" if self.field else ""
        return f"{self.code.value}: {self.message}{where}"

    def __repr__(self) -> str:
        return (
            f"ProtocolError({self.code.value!r}, {self.message!r}, "
            f"field={self.field!r}, request_id={self.request_id!r})"
        )
