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
from hybridd.protocol.fields import FieldReader, check_int, check_str
from hybridd.protocol.limits import MAX_REQUEST_ID_CHARS, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION

SUPPORTED_VERSIONS = frozenset(range(OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION + 1))

MAX_FLOAT = sys.float_info.max
"""The largest finite float: as an upper bound it refuses infinities (NaN fails every bound)."""
Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_FLOAT)]


class Fields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A map inside a message: its fields are all it may hold."""

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready map (bytes stay bytes)."""
        return msgspec.to_builtins(self, builtin_types=(bytes,))


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
    version = check_int(data["v"], "v")
    if version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"v: protocol version {version} is not supported; this side speaks {sorted(SUPPORTED_VERSIONS)}",
            field="v",
        )
    return version


def envelope(type_: str, version: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """The version and type fields every message starts with."""
    return {"v": version, "type": type_}


def open_envelope(data: Mapping[str, Any]) -> FieldReader:
    """Check the version; a reader over the rest of the message (the envelope skipped)."""
    check_version(data)
    reader = FieldReader(data)
    reader.skip("v", "type")
    return reader


def message_type(data: Mapping[str, Any], known: Mapping[str, Any]) -> str:
    if data.get("type") is None:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "type: is required", field="type")
    kind = check_str(data["type"], "type")
    if kind not in known:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, f"type: unknown message type {kind!r}; expected one of {sorted(known)}", field="type"
        )
    return kind


def check_request_id(value: Any, path: str = "id", *, allow_empty: bool = False) -> str:
    return check_str(value, path, min_chars=0 if allow_empty else 1, max_chars=MAX_REQUEST_ID_CHARS)


def peek_request_id(data: Any) -> str | None:
    """The message's `id` if it is a valid one, else None; never raises."""
    if not isinstance(data, Mapping):
        return None
    try:
        return check_request_id(data.get("id"))
    except ProtocolError:
        return None


def reply_version(data: Any) -> int:
    """The version to answer a message in: its own when this side speaks it, else the newest."""
    version = data.get("v") if isinstance(data, Mapping) else None
    return version if type(version) is int and version in SUPPORTED_VERSIONS else PROTOCOL_VERSION
