"""The envelope every message shares: the `v` version and the `type` tag.

Client messages also carry `id`; the rules for it live here too, because error
replies must be attributable even when the rest of a message is broken.

`Message` is the base of the messages decoded by msgspec (the worker control and
supervisor messages): a `msgspec.Struct` tagged by its `type` field, with unknown
fields refused at every nesting level; its field types, with `msgspec.Meta`
constraints for ranges and lengths, are its validation (see `codec.MessageDecoder`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import MAX_REQUEST_ID_CHARS, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION

SUPPORTED_VERSIONS = frozenset(range(OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION + 1))

MAX_FLOAT = sys.float_info.max
"""The largest finite float: as an upper bound it refuses infinities (NaN fails every bound)."""
Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_FLOAT)]


RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
"""A client-chosen request id."""
ReplyId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS)]
"""A reply's id: the request's, or "" when the request's id was unreadable."""


class Fields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A map inside a message: its fields are all it may hold."""

    def wire_form(self) -> msgspec.Struct:
        """What is written for this message: itself, or its shape in an older version."""
        return self

    def current(self) -> Fields:
        """What a decoded message is read as: itself, or an older version's shape as today's class."""
        return self

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready map (bytes stay bytes)."""
        return msgspec.to_builtins(self.wire_form(), builtin_types=(bytes,))


class Message(Fields, tag_field="type", kw_only=True):
    """A whole message: its `tag=` is the wire `type`."""

    v: int = PROTOCOL_VERSION


class Envelope(msgspec.Struct):
    """The envelope alone, read before the message: the other fields are skipped."""

    v: Any = None
    type: Any = None
    id: Any = None


def check_version(data: Envelope | Mapping[str, Any]) -> int:
    """The message's version. Missing or mistyped `v` is invalid_request; an unknown
    integer is unsupported_version."""
    if isinstance(data, Envelope):
        data = {"v": data.v}
    if not isinstance(data, Mapping):
        raise ProtocolError(ErrorCode.MALFORMED, f"a message must be a map, got {type(data).__name__}")
    if data.get("v") is None:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "v: is required (the protocol version)", field="v")
    version = data["v"]
    if type(version) is not int:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"v: expected an integer, got {type(version).__name__}",
                            field="v")
    if version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"v: protocol version {version} is not supported; this side speaks {sorted(SUPPORTED_VERSIONS)}",
            field="v",
        )
    return version


def peek_request_id(data: Any) -> str | None:
    """The message's `id` if it is a valid one, else None; never raises."""
    value = data.get("id") if isinstance(data, Mapping) else None
    return value if type(value) is str and 1 <= len(value) <= MAX_REQUEST_ID_CHARS else None


def reply_version(data: Any) -> int:
    """The version to answer a message in: its own when this side speaks it, else the newest."""
    version = data.get("v") if isinstance(data, Mapping) else None
    return version if type(version) is int and version in SUPPORTED_VERSIONS else PROTOCOL_VERSION
