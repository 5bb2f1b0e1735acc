"""The codec: every message round-trips, and every class of bad frame maps to its ErrorCode."""

from __future__ import annotations

import msgpack
import pytest

from hybridd.protocol import limits
from hybridd.protocol import codec
from hybridd.protocol.codec import decode, encode
from hybridd.protocol.control import Expect, Launched, Ready, ReadyAck, Shutdown, Stats, Step
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.messages import (
    CancelRequest,
    ChatMessage,
    Choice,
    ChunkReply,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    SamplingParams,
    StatusReply,
    StatusRequest,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)

REQUESTS = [
    GenerateRequest(id="r1", prompt="Hello, wörld ✓"),
    GenerateRequest(
        id="r2",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(
            max_tokens=32,
            temperature=0.0,
            top_k=40,
            top_p=0.9,
            seed=1234,
            repetition_penalty=1.1,
            presence_penalty=-0.5,
            frequency_penalty=0.5,
            stop=["\n\n", "END"],
            stop_token_ids=[2],
            ignore_eos=True,
        ),
        stream=False,
        timeout_s=2.5,
    ),
    GenerateRequest(
        id="r3",
        messages=[ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi", name="ROMEO")],
        sampling=SamplingParams(n=3, logprobs=True, top_logprobs=5, seed=7),
    ),
    GenerateRequest(id="r4", prompt="version one", sampling=SamplingParams(max_tokens=3), v=1),
    CancelRequest(id="c1", target="r1"),
    CancelRequest(id="c1", target="r1", v=1),
    StatusRequest(id="s1"),
    HealthRequest(id="h1"),
    HealthRequest(id="h1", v=1),
]

_LOGPROBS = [
    TokenLogprob(token_id=5, text="Hel", logprob=-0.25,
                 top_logprobs=[TopLogprob(token_id=5, text="Hel", logprob=-0.25),
                               TopLogprob(token_id=9, text="\ufffd", logprob=-2.5)]),
    TokenLogprob(token_id=6, text="lo", logprob=0.0),
]

REPLIES = [
    ChunkReply(id="r1", index=0, text="Hel", token_ids=[5, 6]),
    ChunkReply(id="r1", index=2, text="Hel", token_ids=[5, 6], logprobs=_LOGPROBS),
    ChunkReply(id="r1", index=0, number=7, text="Hel", token_ids=[5, 6], v=1),
    FinalReply(
        id="r1",
        choices=[Choice(index=0, text="Hello", token_ids=[5, 6, 7], finish_reason="length")],
        usage=Usage(prompt_tokens=4, completion_tokens=3),
        timings=Timings(ttft_s=0.01, total_s=0.05, queue_s=0.001),
        v=1,
    ),
    FinalReply(
        id="r3",
        choices=[Choice(index=0, text="", token_ids=[], finish_reason="cancelled")],
        usage=Usage(prompt_tokens=4, completion_tokens=0),
        timings=Timings(ttft_s=None, total_s=0.0, queue_s=0.0),
        v=1,
    ),
    FinalReply(
        id="r2",
        choices=[Choice(index=0, text="Hello", token_ids=[5, 6], finish_reason="length", logprobs=_LOGPROBS),
                 Choice(index=1, text="Hi", token_ids=[8], finish_reason="stop")],
        usage=Usage(prompt_tokens=4, completion_tokens=3),
        timings=Timings(ttft_s=0.01, total_s=0.05, queue_s=0.001),
    ),
    ErrorReply(id="", code=ErrorCode.MALFORMED, message="bad"),
    ErrorReply(id="r1", code=ErrorCode.INVALID_REQUEST, message="no", field="sampling.top_p"),
    ErrorReply(id="r1", code=ErrorCode.INVALID_REQUEST, message="no", field="sampling.top_p", v=1),
    StatusReply(id="s1", status={"state": "ready", "queue": {"waiting": 0}}),
    HealthReply(id="h1", state="ready", ok=True),
    HealthReply(id="h1", state="ready", ok=True, v=1),
]


CONTROL = [
    Ready(
        arenas={"kv": {"kind": "shm", "name": "hybridd-1-ab", "nbytes": 256, "device": -1, "owner_pid": 1, "regions": {}}},
        events={"logits_ready": b"", "inputs_ready": b"\x01" * 64},
        model="tiny-llama",
        vocab_size=32000,
        eos_token_ids=[2],
        max_model_len=2048,
        num_kv_blocks=128,
        block_size=16,
        max_batch=32,
        decode_buckets=[1, 2, 4, 8, 16, 32],
        prefill_buckets=[16, 32, 64],
    ),
    ReadyAck(),
    Expect(),
    Step(step=7, kind="decode", n_real=5, n_tokens=5),
    Launched(step=7),
    Stats(stats={"graphs": 6, "replays": 1000}),
    Shutdown(),
]


def _name(message) -> str:
    return f"{type(message).__name__}-v{message.v}"


@pytest.mark.parametrize("message", REQUESTS, ids=_name)
def test_requests_round_trip(message):
    assert codec.REQUESTS.decode(encode(message)) == message


@pytest.mark.parametrize("message", REPLIES, ids=_name)
def test_replies_round_trip(message):
    assert codec.REPLIES.decode(encode(message)) == message


@pytest.mark.parametrize("message", CONTROL, ids=lambda m: type(m).__name__)
def test_control_round_trip(message):
    assert codec.CONTROL.decode(encode(message)) == message


def test_wire_is_a_plain_msgpack_map_with_envelope():
    data = msgpack.unpackb(encode(HealthRequest(id="h")), raw=False)
    assert data == {"v": limits.PROTOCOL_VERSION, "type": "health", "id": "h"}


def test_ints_are_accepted_where_floats_are_expected():
    data = GenerateRequest(id="r", prompt="x").to_wire()
    data["sampling"]["temperature"] = 1
    data["timeout_s"] = 3
    request = codec.REQUESTS.decode(msgpack.packb(data))
    assert request.sampling.temperature == 1.0 and request.timeout_s == 3.0


@pytest.mark.parametrize("version", [1, 2])
def test_optional_fields_may_be_omitted_or_nil(version):
    minimal = {"v": version, "type": "generate", "id": "r", "prompt": "hi"}
    assert codec.REQUESTS.decode(msgpack.packb(minimal)) == GenerateRequest(id="r", prompt="hi", v=version)
    with_nils = minimal | {"prompt_token_ids": None, "sampling": None, "stream": None, "timeout_s": None}
    if version >= 2:
        with_nils |= {"messages": None}
    assert codec.REQUESTS.decode(msgpack.packb(with_nils)) == GenerateRequest(id="r", prompt="hi", v=version)


def test_version_1_writes_the_version_1_shapes():
    """A version 1 peer sees exactly the version 1 fields: no chat, n or logprobs."""
    request = GenerateRequest(id="r", prompt="hi", v=1).to_wire()
    assert "messages" not in request and not {"n", "logprobs", "top_logprobs"} & set(request["sampling"])
    chunk = ChunkReply(id="r", index=0, number=3, text="a", token_ids=[4], v=1).to_wire()
    assert chunk == {"v": 1, "type": "chunk", "id": "r", "index": 3, "text": "a", "token_ids": [4]}
    final = REPLIES[3].to_wire()
    assert set(final) == {"v", "type", "id", "text", "token_ids", "finish_reason", "usage", "timings"}
    assert final["v"] == 1 and final["text"] == "Hello"


@pytest.mark.parametrize("field", ["n", "logprobs", "top_logprobs"])
def test_version_2_sampling_fields_are_unknown_in_version_1(field):
    data = GenerateRequest(id="r", prompt="hi", v=1).to_wire()
    data["sampling"][field] = 1 if field != "logprobs" else True
    error = _error(msgpack.packb(data))
    assert (error.code, error.field) == (ErrorCode.INVALID_REQUEST, f"sampling.{field}")


def test_chat_messages_are_unknown_in_version_1():
    data = {"v": 1, "type": "generate", "id": "r", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    error = _error(msgpack.packb(data))
    assert (error.code, error.field) == (ErrorCode.INVALID_REQUEST, "messages")


def _error(frame: bytes, parse=codec.REQUESTS.decode) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(frame)
    return info.value


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"\x92\x01", b"\x81\xa1v", b"\xa2\xff\xfe", msgpack.packb({"v": 1}) + b"\x00", b"\x91" * 5000],
    ids=["empty", "reserved-byte", "truncated-array", "truncated-map", "bad-utf8", "trailing-bytes", "deep-nesting"],
)
def test_undecodable_bytes_are_malformed(frame):
    assert _error(frame).code is ErrorCode.MALFORMED


@pytest.mark.parametrize("value", [[1, 2], "generate", 1, None, b"\x00"], ids=repr)
def test_non_map_top_level_is_malformed(value):
    error = _error(msgpack.packb(value, use_bin_type=True))
    assert error.code is ErrorCode.MALFORMED and "map" in error.message


def test_non_string_map_keys_are_malformed():
    assert _error(msgpack.packb({1: 2})).code is ErrorCode.MALFORMED


def test_ext_types_are_rejected():
    frame = msgpack.packb({"v": 1, "type": "health", "id": msgpack.ExtType(5, b"x")})
    assert _error(frame).code is ErrorCode.TOO_LARGE  # max_ext_len is 0: no ext is acceptable


def test_missing_version_names_v():
    error = _error(msgpack.packb({"type": "health", "id": "h"}))
    assert (error.code, error.field) == (ErrorCode.INVALID_REQUEST, "v")


def test_mistyped_version_names_v():
    error = _error(msgpack.packb({"v": "1", "type": "health", "id": "h"}))
    assert (error.code, error.field) == (ErrorCode.INVALID_REQUEST, "v")


@pytest.mark.parametrize("version", [0, limits.PROTOCOL_VERSION + 1, 99])
def test_unknown_version_is_unsupported_and_keeps_the_id(version):
    error = _error(msgpack.packb({"v": version, "type": "health", "id": "h7"}))
    assert (error.code, error.field, error.request_id) == (ErrorCode.UNSUPPORTED_VERSION, "v", "h7")
    assert str(version) in error.message


def test_unknown_type_names_type():
    error = _error(msgpack.packb({"v": 1, "type": "generat", "id": "g"}))
    assert (error.code, error.field, error.request_id) == (ErrorCode.INVALID_REQUEST, "type", "g")
    assert "generat" in error.message


def test_control_types_are_not_client_requests():
    error = _error(encode(Shutdown()))
    assert (error.code, error.field) == (ErrorCode.INVALID_REQUEST, "type")


def test_frame_over_message_limit_is_too_large_before_unpacking():
    frame = b"\x00" * (limits.MAX_MESSAGE_BYTES + 1)
    error = _error(frame)
    assert error.code is ErrorCode.TOO_LARGE and str(limits.MAX_MESSAGE_BYTES) in error.message


@pytest.mark.parametrize(
    ("value", "limit_name"),
    [
        (list(range(limits.UNPACK_MAX_ARRAY_LEN + 1)), "max_array_len"),
        ({f"k{i}": i for i in range(limits.UNPACK_MAX_MAP_LEN + 1)}, "max_map_len"),
        (b"\x00" * (limits.UNPACK_MAX_BIN_LEN + 1), "max_bin_len"),
    ],
    ids=["array", "map", "bin"],
)
def test_values_over_unpacker_limits_are_too_large(value, limit_name):
    frame = msgpack.packb({"v": 1, "type": "health", "id": "h", "x": value}, use_bin_type=True)
    error = _error(frame)
    assert error.code is ErrorCode.TOO_LARGE and limit_name in error.message


def test_encode_refuses_frames_the_peer_would_drop():
    huge = ChunkReply(id="r", index=0, text="x" * limits.MAX_MESSAGE_BYTES, token_ids=[])
    with pytest.raises(ProtocolError) as info:
        encode(huge)
    assert (info.value.code, info.value.request_id) == (ErrorCode.TOO_LARGE, "r")


def test_encode_refuses_unencodable_values():
    with pytest.raises(ProtocolError) as info:
        encode({"v": 1, "type": "stats", "stats": {"x": object()}})
    assert info.value.code is ErrorCode.INTERNAL


def test_decode_returns_the_map():
    assert decode(encode(StatusRequest(id="s"))) == {"v": limits.PROTOCOL_VERSION, "type": "status", "id": "s"}


def test_unknown_error_codes_from_a_newer_daemon_read_as_internal():
    frame = msgpack.packb({"v": 1, "type": "error", "id": "r", "code": "quota", "message": "m", "field": None})
    reply = codec.REPLIES.decode(frame)
    assert reply.code is ErrorCode.INTERNAL and "quota" in reply.message
