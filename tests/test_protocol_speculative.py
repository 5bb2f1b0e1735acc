"""The request field of protocol version 4: `speculative` (false turns speculative
decoding off for one request), refused by name in the older versions and when it is
not a boolean; the SDK builds it."""

from __future__ import annotations

import msgspec
import pytest

from hybridd.client.core import build_generate
from hybridd.errors import InvalidRequestError
from hybridd.protocol import codec, limits
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.messages import GenerateRequest


def _frame(data: dict) -> bytes:
    return msgspec.msgpack.encode(data)


def test_a_version_4_request_carries_it():
    assert limits.PROTOCOL_VERSION == 4
    for value in (False, True, None):
        request = GenerateRequest(id="r", prompt="Hello", speculative=value)
        assert codec.REQUESTS.decode(codec.encode(request)).speculative is value


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_versions_do_not_know_it(version):
    data = GenerateRequest(id="r", prompt="Hello", v=version).to_wire() | {"speculative": False}
    with pytest.raises(ProtocolError) as info:
        codec.REQUESTS.decode(_frame(data))
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_REQUEST, "speculative")
    with pytest.raises(ValueError, match="speculative needs protocol version 4"):
        GenerateRequest(id="r", prompt="Hello", speculative=False, v=version).to_wire()


def test_a_version_3_request_still_decodes():
    request = codec.REQUESTS.decode(codec.encode(GenerateRequest(id="r", prompt="Hello", cache_salt="s", v=3)))
    assert (request.v, request.cache_salt, request.speculative) == (3, "s", None)


def test_a_non_boolean_is_refused_by_name():
    data = GenerateRequest(id="r", prompt="Hello").to_wire() | {"speculative": "no"}
    with pytest.raises(ProtocolError) as info:
        codec.REQUESTS.decode(_frame(data))
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_REQUEST, "speculative")


def test_the_sdk_builds_it_and_refuses_a_bad_one():
    request = build_generate("Hello", None, None, {}, request_id="r", stream=False, timeout=None, speculative=False)
    assert request.speculative is False
    with pytest.raises(InvalidRequestError) as info:
        build_generate("Hello", None, None, {}, request_id="r", stream=False, timeout=None, speculative=3)
    assert info.value.field == "speculative"
