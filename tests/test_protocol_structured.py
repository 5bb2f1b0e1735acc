"""Version 4 of the wire: structured output (`sampling.structured`) and tools (a chat's
`tools`, a message's `tool_calls` and `tool_call_id`); versions 1-3, which have none of
them, still spoken."""

from __future__ import annotations

import msgpack
import pytest

from hybridd.protocol import codec, limits
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.messages import ChatMessage, GenerateRequest, SamplingParams, StructuredOutput, ToolCall, ToolSpec

SCHEMA = '{"type": "object", "properties": {"city": {"type": "string"}}}'


def _frame(data: dict) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def _decode_error(data: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        codec.REQUESTS.decode(_frame(data))
    return info.value


def _chat(**fields) -> GenerateRequest:
    calls = [ToolCall(id="call_1", name="weather", arguments='{"city": "Verona"}')]
    messages = [ChatMessage(role="user", content="Weather?"), ChatMessage(role="assistant", content="",
                                                                          tool_calls=calls),
                ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    return GenerateRequest(id="r", messages=messages, tools=[ToolSpec(name="weather", parameters=SCHEMA)], **fields)


@pytest.mark.parametrize("structured", [StructuredOutput(json=SCHEMA), StructuredOutput(json_object=True),
                                        StructuredOutput(regex="[0-9]+"), StructuredOutput(grammar='start: "a"'),
                                        StructuredOutput(choice=["yes", "no"])],
                         ids=["json", "json_object", "regex", "grammar", "choice"])
def test_a_version_4_request_carries_its_structured_output(structured):
    request = GenerateRequest(id="r", prompt="Hello", sampling=SamplingParams(structured=structured))
    assert request.v == limits.PROTOCOL_VERSION == 4
    decoded = codec.REQUESTS.decode(codec.encode(request))
    assert decoded.sampling.structured == structured and decoded.sampling.structured.kind == structured.kind


@pytest.mark.parametrize("structured, field", [
    ({}, "sampling.structured"),
    ({"json": SCHEMA, "regex": "a"}, "sampling.structured"),
    ({"json": ""}, "sampling.structured.json"),
    ({"choice": []}, "sampling.structured.choice"),
    ({"choice": ["x"] * (limits.MAX_CHOICES + 1)}, "sampling.structured.choice"),
    ({"regex": "x" * (limits.MAX_STRUCTURED_CHARS + 1)}, "sampling.structured.regex"),
    ({"json": SCHEMA, "unknown": 1}, "sampling.structured.unknown"),
], ids=["none", "two", "empty-schema", "no-choice", "too-many-choices", "too-long", "unknown-field"])
def test_a_bad_structured_output_is_refused_by_name(structured, field):
    data = GenerateRequest(id="r", prompt="Hello").to_wire()
    data["sampling"] = {"structured": structured}
    error = _decode_error(data)
    assert error.code in (ErrorCode.INVALID_REQUEST, ErrorCode.TOO_LARGE) and error.field == field


def test_a_chat_carries_its_tools_and_tool_calls_and_templates_read_them_as_openai_writes_them():
    decoded = codec.REQUESTS.decode(codec.encode(_chat()))
    assert decoded.tools == [ToolSpec(name="weather", parameters=SCHEMA)]
    assistant, tool = decoded.messages[1].as_dict(), decoded.messages[2].as_dict()
    assert assistant["tool_calls"] == [{"id": "call_1", "type": "function",
                                        "function": {"name": "weather", "arguments": {"city": "Verona"}}}]
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_tools_need_a_chat_and_a_function_name_of_openais_letters():
    error = _decode_error(GenerateRequest(id="r", prompt="Hello").to_wire() | {"tools": [{"name": "f"}]})
    assert error.field == "tools"
    data = _chat().to_wire()
    data["tools"][0]["name"] = "no spaces"
    assert _decode_error(data).field == "tools[0].name"


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_versions_know_no_structured_output_nor_tools(version):
    plain = GenerateRequest(id="r", prompt="Hello", v=version)
    assert codec.REQUESTS.decode(codec.encode(plain)).sampling.structured is None
    with_structured = plain.to_wire()
    with_structured["sampling"] = {"structured": {"regex": "a"}}
    assert _decode_error(with_structured).field == "sampling.structured"
    with pytest.raises(ValueError, match="version 4"):
        GenerateRequest(id="r", prompt="Hello", sampling=SamplingParams(structured=StructuredOutput(regex="a")),
                        v=version).to_wire()
    if version >= 2:
        with pytest.raises(ValueError, match="version 4"):
            _chat(v=version).to_wire()
        chat = GenerateRequest(id="r", messages=[ChatMessage(role="user", content="hi")], v=version).to_wire()
        assert _decode_error(chat | {"tools": []}).field == "tools"
        chat["messages"][0]["tool_call_id"] = "call_1"
        assert _decode_error(chat).field == "messages[0].tool_call_id"
