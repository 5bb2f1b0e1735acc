"""Bytes ↔ messages: bounded msgpack encoding and decoding, never pickle.

`MessageDecoder` turns one frame into one typed message of a family (`REQUESTS`,
`REPLIES`, `CONTROL`, `WORKER_REPORTS`, `SUPERVISOR_COMMANDS`): the envelope is read
first (version), then msgspec decodes the frame straight into that version's struct,
checking every type, range and length in one pass. `decode` is the untyped path: one
frame into a checked map (size, msgpack validity, map at the top, supported version). A frame that fails is diagnosed again on the slow
path, in the order SPEC.md gives: frame size, msgpack validity and the decoder
bounds (`malformed`, `too_large`), a map at the top, the version, then the first
offending field, named by its dotted path in `ProtocolError.field` and at the start
of the message.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import msgpack
import msgspec

from hybridd.protocol.control import ControlMessage
from hybridd.protocol.envelope import SUPPORTED_VERSIONS, Envelope, Fields, check_version, peek_request_id, reply_version
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    UNPACK_MAX_ARRAY_LEN,
    UNPACK_MAX_BIN_LEN,
    UNPACK_MAX_EXT_LEN,
    UNPACK_MAX_MAP_LEN,
    UNPACK_MAX_STR_LEN,
)
from hybridd.protocol.messages import REPLY_FORMS, REQUEST_FORMS, Reply, Request
from hybridd.protocol.supervisor import SupervisorCommand, WorkerReport

M = TypeVar("M")

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


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(message: WireMessage | msgspec.Struct | Mapping[str, Any]) -> bytes:
    """One message → one frame. Refuses frames the peer would drop as too large."""
    data = message.wire_form() if isinstance(message, Fields) else message
    data = data if isinstance(data, Mapping | msgspec.Struct) else data.to_wire()
    try:
        frame = _encoder.encode(data)
    except (TypeError, ValueError, OverflowError) as error:
        raise ProtocolError(ErrorCode.INTERNAL, f"cannot encode message: {error}") from error
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"encoded message is {len(frame)} bytes, over the limit of {MAX_MESSAGE_BYTES}",
            request_id=peek_request_id(data if isinstance(data, Mapping) else {"id": getattr(data, "id", None)}),
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


class MessageDecoder(Generic[M]):
    """Frames → the messages of one family: a union of `Message` structs tagged by `type`,
    the same in every version unless `forms` gives a version its own union."""

    def __init__(self, family: Any, forms: dict[int, Any] | None = None) -> None:
        forms = forms or {}
        self._decoders = {v: msgspec.msgpack.Decoder(forms.get(v, family)) for v in SUPPORTED_VERSIONS}
        self.types = sorted({member.__struct_config__.tag for form in [family, *forms.values()]
                             for member in typing.get_args(form)} - {None})

    def decode(self, frame: bytes | memoryview) -> M:
        if len(frame) > MAX_MESSAGE_BYTES:
            decode(frame)  # raises too_large
        try:
            version = check_version(_envelope_decoder.decode(frame))
            return self._decoders[version].decode(frame).current()
        except (msgspec.MsgspecError, RecursionError, ProtocolError) as error:
            self._diagnose(frame, error)

    def _diagnose(self, frame: bytes | memoryview, error: Exception) -> NoReturn:
        """Raise the ProtocolError SPEC.md asks for, for a frame the fast path refused."""
        try:
            data = decode(frame)  # malformed, too_large, not a map, bad version: the earlier rules win
        except ProtocolError as refused:
            refused.version = PROTOCOL_VERSION
            raise
        request_id, version = peek_request_id(data), reply_version(data)
        if isinstance(error, msgspec.ValidationError):
            kind = data.get("type")
            if type(kind) is str and kind not in self.types:
                error = ProtocolError(
                    ErrorCode.INVALID_REQUEST, f"type: unknown message type {kind!r}; expected one of {self.types}",
                    field="type",
                )
            else:
                error = _field_error(str(error), data)
        elif not isinstance(error, ProtocolError):
            error = ProtocolError(ErrorCode.MALFORMED, f"not one valid message ({error})")
        error.request_id, error.version = request_id, version
        raise error from None


# msgspec's messages: "<what> - at `$.info.workers`", "... - at `key` in `$.info.workers`".
_LOCATION = re.compile(r"^(?P<text>.*?)(?: - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`)?$", re.DOTALL)
_BAD_KEY = re.compile(r"^Invalid enum value '(?P<name>[^']*)'$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")
_NAMED = re.compile(r"^(?P<name>[A-Za-z_]\w*): (?P<text>.*)$", re.DOTALL)  # __post_init__'s "field: reason"
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def _field_error(text: str, data: Any, prefix: str = "") -> ProtocolError:
    match = _LOCATION.match(text)
    assert match is not None  # the pattern matches any text
    text, path = match["text"], match["path"] or ""
    code = ErrorCode.INVALID_REQUEST
    if match["key"] and (named := _BAD_KEY.match(text)):
        path, text = f"{path}.{named['name']}", "not a known key"
    elif named := _UNKNOWN.match(text):
        path, text = f"{path}.{named['name']}", "unknown field"
    elif named := _MISSING.match(text):
        path, text = f"{path}.{named['name']}", "is required"
    elif named := _NAMED.match(text):
        path, text = f"{path}.{named['name']}", named["text"]
    else:
        if " of length <= " in text:
            code = ErrorCode.TOO_LARGE
        text = text[:1].lower() + text[1:] + _got(text, _value_at(data, path))
    field = f"{prefix}{path}".removeprefix(".") or "message"
    return ProtocolError(code, f"{field}: {text}", field=field)


def _value_at(data: Any, path: str) -> Any:
    if "[...]" in path:  # msgspec does not say which key of a map
        return None
    for name, index in _STEP.findall(path):
        try:
            data = data[name] if name else data[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _got(text: str, value: Any) -> str:
    """What the value was, where msgspec's message does not say."""
    if ", got " in text:
        return ""
    if isinstance(value, str | bytes | list):
        return "" if "length" not in text else f", got length {len(value)}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f", got {value!r}"
    return ""


def convert(data: Any, type_: type[M], where: str) -> M:
    """A plain map nested in a message (e.g. an arena manifest) → its typed form; errors name `where.field`."""
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as error:
        raise _field_error(str(error), data, prefix=where) from None


REQUESTS: MessageDecoder[Request] = MessageDecoder(Request, REQUEST_FORMS)
REPLIES: MessageDecoder[Reply] = MessageDecoder(Reply, REPLY_FORMS)
CONTROL: MessageDecoder[ControlMessage] = MessageDecoder(ControlMessage)
WORKER_REPORTS: MessageDecoder[WorkerReport] = MessageDecoder(WorkerReport)
SUPERVISOR_COMMANDS: MessageDecoder[SupervisorCommand] = MessageDecoder(SupervisorCommand)
