"""Bytes ↔ messages: bounded msgpack encoding and decoding, never pickle.

`decode` turns one frame into a checked map (size, msgpack validity, map at the top,
supported version) and raises `ProtocolError` otherwise; `parse_request`,
`parse_reply` and `parse_control` add the per-message validation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import msgpack

from hybridd.protocol.control import ControlMessage, control_from_wire
from hybridd.protocol.envelope import check_version, peek_request_id
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import (
    MAX_MESSAGE_BYTES,
    UNPACK_MAX_ARRAY_LEN,
    UNPACK_MAX_BIN_LEN,
    UNPACK_MAX_EXT_LEN,
    UNPACK_MAX_MAP_LEN,
    UNPACK_MAX_STR_LEN,
)
from hybridd.protocol.messages import Reply, Request, reply_from_wire, request_from_wire

_UNPACK_OPTIONS: dict[str, Any] = {
    "raw": False,
    "strict_map_key": True,
    "use_list": True,
    "max_str_len": UNPACK_MAX_STR_LEN,
    "max_bin_len": UNPACK_MAX_BIN_LEN,
    "max_array_len": UNPACK_MAX_ARRAY_LEN,
    "max_map_len": UNPACK_MAX_MAP_LEN,
    "max_ext_len": UNPACK_MAX_EXT_LEN,
}


class WireMessage(Protocol):
    def to_wire(self) -> dict[str, Any]: ...


def encode(message: WireMessage | Mapping[str, Any]) -> bytes:
    """One message → one frame. Refuses frames the peer would drop as too large."""
    data = message if isinstance(message, Mapping) else message.to_wire()
    try:
        frame = msgpack.packb(data, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as error:
        raise ProtocolError(ErrorCode.INTERNAL, f"cannot encode message: {error}") from error
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"encoded message is {len(frame)} bytes, over the limit of {MAX_MESSAGE_BYTES}",
            request_id=peek_request_id(data),
        )
    return frame


def decode(frame: bytes | memoryview) -> dict[str, Any]:
    """One frame → one map with a supported `v`; anything else raises ProtocolError."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"message is {len(frame)} bytes, over the limit of {MAX_MESSAGE_BYTES}"
        )
    try:
        data = msgpack.unpackb(frame, **_UNPACK_OPTIONS)
    except ValueError as error:  # includes msgpack's FormatError, StackError, ExtraData, UnicodeDecodeError
        text = str(error)
        if "exceeds max_" in text:
            # A string, array, map or bin longer than the unpacker allows.
            raise ProtocolError(ErrorCode.TOO_LARGE, f"message has a value over an unpacker limit: {text}") from None
        raise ProtocolError(
            ErrorCode.MALFORMED, f"not one valid msgpack value ({type(error).__name__}{': ' + text if text else ''})"
        ) from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"a message must be a msgpack map, got {type(data).__name__}")
    try:
        check_version(data)
    except ProtocolError as error:
        error.request_id = peek_request_id(data)
        raise
    return data


def parse_request(frame: bytes | memoryview) -> Request:
    return request_from_wire(decode(frame))


def parse_reply(frame: bytes | memoryview) -> Reply:
    return reply_from_wire(decode(frame))


def parse_control(frame: bytes | memoryview) -> ControlMessage:
    return control_from_wire(decode(frame))
