"""Version 3 of the wire: a request's `cache_salt` and the final's `usage.cached_tokens`,
and versions 1 and 2, which have neither, still spoken."""

from __future__ import annotations

import msgpack
import pytest

from hybridd.protocol import codec, limits
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.messages import (
    ChatMessage, Choice, FinalReply, GenerateRequest, SamplingParams, Timings, Usage,
)


def _frame(data: dict) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def _final(v: int) -> FinalReply:
    return FinalReply(id="r", choices=[Choice(index=0, text="hi", token_ids=[1], finish_reason="stop")],
                      usage=Usage(prompt_tokens=40, completion_tokens=1, cached_tokens=32),
                      timings=Timings(ttft_s=0.1, total_s=0.2, queue_s=0.0), v=v)


def test_a_version_3_request_carries_its_salt():
    request = GenerateRequest(id="r", prompt="Hello", cache_salt="tenant-a", v=3)
    assert request.to_wire()["cache_salt"] == "tenant-a"
    assert codec.REQUESTS.decode(codec.encode(request)).cache_salt == "tenant-a"
    assert codec.REQUESTS.decode(codec.encode(GenerateRequest(id="r", prompt="Hello"))).cache_salt is None


@pytest.mark.parametrize("salt, code", [("", ErrorCode.INVALID_REQUEST), (7, ErrorCode.INVALID_REQUEST),
                                        ("x" * (limits.MAX_CACHE_SALT_CHARS + 1), ErrorCode.TOO_LARGE)],
                         ids=["empty", "not-a-string", "too-long"])
def test_a_bad_salt_is_refused_by_name(salt, code):
    data = GenerateRequest(id="r", prompt="Hello").to_wire() | {"cache_salt": salt}
    with pytest.raises(ProtocolError) as info:
        codec.REQUESTS.decode(_frame(data))
    assert (info.value.code, info.value.field) == (code, "cache_salt")


@pytest.mark.parametrize("version", [1, 2])
def test_older_versions_know_no_salt(version):
    plain = GenerateRequest(id="r", prompt="Hello", v=version)
    decoded = codec.REQUESTS.decode(codec.encode(plain))
    assert decoded.v == version and decoded.cache_salt is None
    with pytest.raises(ProtocolError) as info:
        codec.REQUESTS.decode(_frame(plain.to_wire() | {"cache_salt": "tenant-a"}))
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_REQUEST, "cache_salt")
    with pytest.raises(ValueError, match="version 3"):
        GenerateRequest(id="r", prompt="Hello", cache_salt="a", v=version).to_wire()


def test_a_version_2_request_keeps_its_chat_and_n():
    request = GenerateRequest(id="r", messages=[ChatMessage(role="user", content="hi")], v=2,
                              sampling=SamplingParams(n=2, logprobs=True))
    decoded = codec.REQUESTS.decode(codec.encode(request))
    assert decoded.v == 2 and decoded.messages[0].content == "hi" and decoded.sampling.n == 2


@pytest.mark.parametrize("version", [1, 2, 3])
def test_cached_tokens_are_in_the_version_3_final_only(version):
    wire = _final(version).to_wire()
    assert ("cached_tokens" in wire["usage"]) is (version >= 3)
    decoded = codec.REPLIES.decode(codec.encode(_final(version)))
    assert decoded.usage.prompt_tokens == 40
    assert decoded.usage.cached_tokens == (32 if version >= 3 else 0)
