"""Field validation of client and control messages: the right code, and the field named."""

from __future__ import annotations

import copy

import msgpack
import pytest

from hybridd.protocol import limits
from hybridd.protocol import codec
from hybridd.protocol.codec import decode, encode
from hybridd.protocol.control import Expect, Launched, Step
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.messages import ErrorReply, GenerateRequest, SamplingParams

INVALID = ErrorCode.INVALID_REQUEST
TOO_LARGE = ErrorCode.TOO_LARGE


def _generate(**overrides) -> dict:
    data = GenerateRequest(id="req-1", prompt="Hello").to_wire()
    data.update(overrides)
    return data


def _with_sampling(**overrides) -> dict:
    data = _generate()
    data["sampling"].update(overrides)
    return data


def _rejects(data: dict, parse=codec.REQUESTS.decode) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(msgpack.packb(data, use_bin_type=True))
    return info.value


CASES = [
    # (case id, message, code, field)
    ("unknown-field", _generate(promt="x"), INVALID, "promt"),
    ("unknown-sampling-field", _with_sampling(min_p=0.1), INVALID, "sampling.min_p"),
    ("missing-id", {k: v for k, v in _generate().items() if k != "id"}, INVALID, "id"),
    ("nil-id", _generate(id=None), INVALID, "id"),
    ("empty-id", _generate(id=""), INVALID, "id"),
    ("long-id", _generate(id="x" * (limits.MAX_REQUEST_ID_CHARS + 1)), TOO_LARGE, "id"),
    ("int-id", _generate(id=7), INVALID, "id"),
    ("no-prompt", _generate(prompt=None), INVALID, "prompt"),
    ("both-prompts", _generate(prompt_token_ids=[1]), INVALID, "prompt"),
    ("empty-prompt", _generate(prompt=""), INVALID, "prompt"),
    ("bytes-prompt", _generate(prompt=b"hi"), INVALID, "prompt"),
    ("long-prompt", _generate(prompt="x" * (limits.MAX_PROMPT_CHARS + 1)), TOO_LARGE, "prompt"),
    ("empty-token-ids", _generate(prompt=None, prompt_token_ids=[]), INVALID, "prompt_token_ids"),
    ("token-ids-not-list", _generate(prompt=None, prompt_token_ids="1 2"), INVALID, "prompt_token_ids"),
    ("negative-token-id", _generate(prompt=None, prompt_token_ids=[1, -2]), INVALID, "prompt_token_ids[1]"),
    ("float-token-id", _generate(prompt=None, prompt_token_ids=[1, 2, 3.0]), INVALID, "prompt_token_ids[2]"),
    ("bool-token-id", _generate(prompt=None, prompt_token_ids=[True]), INVALID, "prompt_token_ids[0]"),
    (
        "too-many-token-ids",
        _generate(prompt=None, prompt_token_ids=[1] * (limits.MAX_PROMPT_TOKEN_IDS + 1)),
        TOO_LARGE,
        "prompt_token_ids",
    ),
    ("sampling-not-map", _generate(sampling=[1]), INVALID, "sampling"),
    ("stream-int", _generate(stream=1), INVALID, "stream"),
    ("timeout-zero", _generate(timeout_s=0), INVALID, "timeout_s"),
    ("timeout-huge", _generate(timeout_s=limits.MAX_TIMEOUT_S + 1), INVALID, "timeout_s"),
    ("timeout-string", _generate(timeout_s="5"), INVALID, "timeout_s"),
    ("max-tokens-zero", _with_sampling(max_tokens=0), INVALID, "sampling.max_tokens"),
    ("max-tokens-over-cap", _with_sampling(max_tokens=limits.MAX_TOKENS_CAP + 1), INVALID, "sampling.max_tokens"),
    ("max-tokens-float", _with_sampling(max_tokens=16.0), INVALID, "sampling.max_tokens"),
    ("max-tokens-bool", _with_sampling(max_tokens=True), INVALID, "sampling.max_tokens"),
    ("temperature-negative", _with_sampling(temperature=-0.1), INVALID, "sampling.temperature"),
    ("temperature-nan", _with_sampling(temperature=float("nan")), INVALID, "sampling.temperature"),
    ("temperature-inf", _with_sampling(temperature=float("inf")), INVALID, "sampling.temperature"),
    ("top-k-below-off", _with_sampling(top_k=-2), INVALID, "sampling.top_k"),
    ("top-p-zero", _with_sampling(top_p=0.0), INVALID, "sampling.top_p"),
    ("top-p-over-one", _with_sampling(top_p=1.01), INVALID, "sampling.top_p"),
    ("seed-negative", _with_sampling(seed=-1), INVALID, "sampling.seed"),
    ("seed-over-int64", _with_sampling(seed=2**63), INVALID, "sampling.seed"),
    ("repetition-zero", _with_sampling(repetition_penalty=0), INVALID, "sampling.repetition_penalty"),
    ("presence-out-of-range", _with_sampling(presence_penalty=2.5), INVALID, "sampling.presence_penalty"),
    ("frequency-out-of-range", _with_sampling(frequency_penalty=-3), INVALID, "sampling.frequency_penalty"),
    ("stop-not-list", _with_sampling(stop="END"), INVALID, "sampling.stop"),
    ("stop-item-int", _with_sampling(stop=["a", 3]), INVALID, "sampling.stop[1]"),
    ("stop-item-empty", _with_sampling(stop=[""]), INVALID, "sampling.stop[0]"),
    ("too-many-stops", _with_sampling(stop=["x"] * (limits.MAX_STOP_STRINGS + 1)), TOO_LARGE, "sampling.stop"),
    (
        "stop-too-long",
        _with_sampling(stop=["ok", "x" * (limits.MAX_STOP_STRING_CHARS + 1)]),
        TOO_LARGE,
        "sampling.stop[1]",
    ),
    (
        "too-many-stop-ids",
        _with_sampling(stop_token_ids=[1] * (limits.MAX_STOP_TOKEN_IDS + 1)),
        TOO_LARGE,
        "sampling.stop_token_ids",
    ),
    ("stop-id-negative", _with_sampling(stop_token_ids=[-1]), INVALID, "sampling.stop_token_ids[0]"),
    ("ignore-eos-string", _with_sampling(ignore_eos="yes"), INVALID, "sampling.ignore_eos"),
    ("type-missing", {"v": 1, "id": "x"}, INVALID, "type"),
    ("type-not-string", {"v": 1, "id": "x", "type": 3}, INVALID, "type"),
    ("cancel-without-target", {"v": 1, "id": "c", "type": "cancel"}, INVALID, "target"),
    ("cancel-target-int", {"v": 1, "id": "c", "type": "cancel", "target": 5}, INVALID, "target"),
    ("health-extra-field", {"v": 1, "id": "h", "type": "health", "verbose": True}, INVALID, "verbose"),
    # version 2: chat, n and logprobs
    ("n-zero", _with_sampling(n=0), INVALID, "sampling.n"),
    ("n-over-max", _with_sampling(n=limits.MAX_N + 1), INVALID, "sampling.n"),
    ("logprobs-int", _with_sampling(logprobs=1), INVALID, "sampling.logprobs"),
    ("top-logprobs-over-max", _with_sampling(logprobs=True, top_logprobs=limits.MAX_TOP_LOGPROBS + 1), INVALID,
     "sampling.top_logprobs"),
    ("top-logprobs-without-logprobs", _with_sampling(top_logprobs=3), INVALID, "sampling.top_logprobs"),
    ("final-logprobs-over-limit",
     _generate(stream=False, sampling=SamplingParams(max_tokens=limits.MAX_FINAL_LOGPROB_ENTRIES // 2 + 1, n=2,
                                                     logprobs=True).to_wire()),
     INVALID, "sampling.top_logprobs"),
    ("messages-and-prompt", _generate(messages=[{"role": "user", "content": "hi"}]), INVALID, "prompt"),
    ("messages-empty", _generate(prompt=None, messages=[]), INVALID, "messages"),
    ("messages-not-list", _generate(prompt=None, messages={"role": "user"}), INVALID, "messages"),
    ("message-not-map", _generate(prompt=None, messages=["hi"]), INVALID, "messages[0]"),
    ("message-without-role", _generate(prompt=None, messages=[{"content": "hi"}]), INVALID, "messages[0].role"),
    ("message-content-int", _generate(prompt=None, messages=[{"role": "user", "content": 1}]), INVALID,
     "messages[0].content"),
    ("message-unknown-field", _generate(prompt=None, messages=[{"role": "user", "content": "a", "tone": "x"}]),
     INVALID, "messages[0].tone"),
    ("message-long-role", _generate(prompt=None, messages=[{"role": "r" * (limits.MAX_CHAT_ROLE_CHARS + 1),
                                                            "content": "a"}]), TOO_LARGE, "messages[0].role"),
    ("too-many-messages", _generate(prompt=None, messages=[{"role": "user", "content": "a"}]
                                    * (limits.MAX_CHAT_MESSAGES + 1)), TOO_LARGE, "messages"),
    ("messages-too-long", _generate(prompt=None, messages=[{"role": "user", "content": "x" * (limits.MAX_PROMPT_CHARS // 2 + 1)}] * 2),
     TOO_LARGE, "messages"),
]


@pytest.mark.parametrize(("data", "code", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_requests_name_their_field(data, code, field):
    error = _rejects(data)
    assert (error.code, error.field) == (code, field)
    assert error.message.startswith(f"{field}:"), error.message


def test_errors_carry_the_request_id_when_it_is_valid():
    assert _rejects(_with_sampling(top_p=2.0)).request_id == "req-1"
    assert _rejects(_generate(id=5)).request_id is None


def test_error_reply_from_error_is_routable():
    error = _rejects(_with_sampling(top_k=-5))
    reply = ErrorReply.from_error(error)
    assert (reply.id, reply.code, reply.field) == ("req-1", INVALID, "sampling.top_k")
    assert codec.REPLIES.decode(encode(reply)).field == "sampling.top_k"
    anonymous = ErrorReply.from_error(ProtocolError(ErrorCode.MALFORMED, "x" * 10_000))
    assert anonymous.id == "" and len(anonymous.message) == limits.MAX_ERROR_MESSAGE_CHARS


def test_defaults_match_the_spec():
    request = codec.REQUESTS.decode(msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt_token_ids": [1]}))
    assert request.stream is True and request.timeout_s is None
    assert request.sampling == SamplingParams()
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.seed) == (16, 1.0, 0, 1.0, None)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (s.stop, s.stop_token_ids, s.ignore_eos) == ([], [], False)


def test_limits_at_the_boundary_are_accepted():
    data = _with_sampling(
        max_tokens=limits.MAX_TOKENS_CAP,
        stop=["x" * limits.MAX_STOP_STRING_CHARS] * limits.MAX_STOP_STRINGS,
        stop_token_ids=[0] * limits.MAX_STOP_TOKEN_IDS,
        top_k=-1,
        temperature=0,
        top_p=1,
    )
    data["id"] = "i" * limits.MAX_REQUEST_ID_CHARS
    data["prompt"] = "p" * limits.MAX_PROMPT_CHARS
    assert codec.REQUESTS.decode(msgpack.packb(data)).sampling.greedy
    by_ids = _generate(prompt=None, prompt_token_ids=[limits.MAX_TOKEN_ID] * limits.MAX_PROMPT_TOKEN_IDS)
    assert len(codec.REQUESTS.decode(msgpack.packb(by_ids)).prompt_token_ids) == limits.MAX_PROMPT_TOKEN_IDS


def test_reply_validation_rejects_wrong_types():
    final = {
        "v": 1,
        "type": "final",
        "id": "r",
        "text": "t",
        "token_ids": [1],
        "finish_reason": "done",
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
        "timings": {"ttft_s": 0.1, "total_s": 0.2, "queue_s": 0.0},
    }
    assert _rejects(final, codec.REPLIES.decode).field == "finish_reason"
    broken_usage = copy.deepcopy(final) | {"finish_reason": "stop"}
    broken_usage["usage"]["completion_tokens"] = "1"
    assert _rejects(broken_usage, codec.REPLIES.decode).field == "usage.completion_tokens"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (Step(step=1, kind="decode", n_real=3, n_tokens=3).to_wire() | {"kind": "verify"}, "kind"),
        (Step(step=1, kind="decode", n_real=3, n_tokens=3).to_wire() | {"n_real": -1}, "n_real"),
        (Step(step=1, kind="decode", n_real=3, n_tokens=3).to_wire() | {"step": "1"}, "step"),
        (Launched(step=1).to_wire() | {"step": -1}, "step"),
        (Launched(step=1).to_wire() | {"extra": 1}, "extra"),
        (Expect().to_wire() | {"step": 1}, "step"),
        ({"v": 1, "type": "ready"}, "arenas"),
    ],
    ids=["step-kind", "step-n-real", "step-type", "launched-step", "launched-extra", "expect-extra", "ready-empty"],
)
def test_control_messages_reject_wrong_types(data, field):
    error = _rejects(data, codec.CONTROL.decode)
    assert (error.code, error.field) == (INVALID, field)


def test_the_engine_samples_with_the_wire_sampling_params():
    """One SamplingParams, one set of rules, checked when a request is decoded; the field is named."""
    good = SamplingParams(max_tokens=5, temperature=0.0, top_k=-1, top_p=0.5, seed=0, stop="x")
    assert good.stop == ["x"] and good.greedy and not good.has_penalties
    assert codec.REQUESTS.decode(encode(GenerateRequest(id="r", prompt="p", sampling=good))).sampling == good
    bad = {
        "max_tokens": 0,
        "temperature": -0.1,
        "top_k": -2,
        "top_p": 0.0,
        "seed": -3,  # SPEC: 0 ... 2**63 - 1
        "repetition_penalty": 0.0,
        "presence_penalty": 2.5,
        "frequency_penalty": float("nan"),
        "stop": [""],
        "stop_token_ids": [-1],
        "ignore_eos": "yes",
    }
    for name, value in bad.items():
        request = GenerateRequest(id="r", prompt="p", sampling=SamplingParams(**{name: value}))
        with pytest.raises(ProtocolError) as info:
            codec.REQUESTS.decode(encode(request))
        assert info.value.field.startswith(f"sampling.{name}"), info.value
        assert info.value.message.startswith(info.value.field), info.value
