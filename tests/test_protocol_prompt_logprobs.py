"""Version 4's `sampling.prompt_logprobs` and the final's `prompt_logprobs`: their bounds,
and the older versions, which have neither."""

from __future__ import annotations

import msgpack
import pytest

from hybridd.protocol import codec
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.messages import (Choice, FinalReply, GenerateRequest, PromptLogprob, SamplingParams, Timings,
                                       Usage)


def _frame(data: dict) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def test_a_version_4_request_asks_for_its_prompts_logprobs():
    request = codec.REQUESTS.decode(_frame({"v": 4, "type": "generate", "id": "r", "prompt": "Hi",
                                            "sampling": {"prompt_logprobs": 3}}))
    assert request.sampling.prompt_logprobs == 3
    assert codec.REQUESTS.decode(codec.encode(GenerateRequest(id="r", prompt="Hi"))).sampling.prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, "1", 1.5])
def test_prompt_logprobs_out_of_range_are_refused_by_name(value):
    with pytest.raises(ProtocolError) as info:
        codec.REQUESTS.decode(_frame({"v": 4, "type": "generate", "id": "r", "prompt": "Hi",
                                      "sampling": {"prompt_logprobs": value}}))
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_REQUEST, "sampling.prompt_logprobs")


@pytest.mark.parametrize("version", [2, 3])
def test_older_versions_know_no_prompt_logprobs(version):
    with pytest.raises(ProtocolError) as info:
        codec.REQUESTS.decode(_frame({"v": version, "type": "generate", "id": "r", "prompt": "Hi",
                                      "sampling": {"prompt_logprobs": 1}}))
    assert info.value.code == ErrorCode.INVALID_REQUEST and "prompt_logprobs" in info.value.message
    with pytest.raises(ValueError, match="version 4"):
        codec.encode(GenerateRequest(id="r", prompt="Hi", sampling=SamplingParams(prompt_logprobs=1), v=version))


def test_the_final_carries_them_from_version_4_only():
    entry = PromptLogprob(token_id=5, text="a", logprob=-1.5, rank=2)
    final = {v: FinalReply(id="r", choices=[Choice(index=0, text="x", token_ids=[1], finish_reason="stop")],
                           usage=Usage(prompt_tokens=2, completion_tokens=1),
                           timings=Timings(ttft_s=0.1, total_s=0.2, queue_s=0.0), prompt_logprobs=[None, entry], v=v)
             for v in (3, 4)}
    wire = {v: msgpack.unpackb(codec.encode(f)) for v, f in final.items()}
    assert "prompt_logprobs" not in wire[3]
    assert wire[4]["prompt_logprobs"] == [None, {"token_id": 5, "text": "a", "logprob": -1.5, "top_logprobs": [],
                                                 "rank": 2}]
    assert codec.REPLIES.decode(codec.encode(final[4])).prompt_logprobs == [None, entry]
