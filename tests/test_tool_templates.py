"""Tools through the chat templates of the three families that define them differently
(Llama 3.1, Qwen2.5 / Qwen3's Hermes format, Mistral), written into tiny tokenizers
(tests/chat_templates/: the published templates' Jinja), and the gateway's parsers of
each family's calls: the family told from the template, a call and its result rendered
into the prompt from the wire's messages, and the model's calls read back, whole and
streamed in small pieces (the reader's own cases: tests/test_tool_call_reader.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridd.engine.prompt import chat_text
from hybridd.gateway.tool_call_reader import CallOpened, CallReader, parse
from hybridd.gateway.tool_calls import ToolPlan, call_id, plan, template_format
from hybridd.protocol.messages import ChatMessage, ToolCall, ToolSpec

TEMPLATES = Path(__file__).parent / "chat_templates"
FAMILIES = {"llama3_1.jinja": "llama3_json", "qwen2_5.jinja": "hermes", "mistral_v3.jinja": "mistral"}
WEATHER = ToolSpec(name="get_weather", description="The weather in a city.",
                   parameters='{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}')
# What each family's model writes to call get_weather (after some words, where the format allows them).
OUTPUTS = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Verona"}}',
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Verona"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Mantua"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Verona"}}]',
}
CALLS = {"llama3_json": ["Verona"], "hermes": ["Verona", "Mantua"], "mistral": ["Verona"]}
CONTENT = {"llama3_json": "", "hermes": "Let me look.", "mistral": ""}


def _tokenizer_dir(tmp_path: Path, template: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = tmp_path / template.removesuffix(".jinja")
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": (TEMPLATES / template).read_text()}))
    return directory


@pytest.mark.parametrize("template", FAMILIES)
def test_a_call_and_its_result_render_through_each_familys_template(tmp_path, template):
    from hybridd.model import load_tokenizer

    directory = _tokenizer_dir(tmp_path, template)
    fmt = template_format(directory)
    assert fmt == FAMILIES[template]
    call = ToolCall(id=call_id(fmt), name="get_weather", arguments='{"city": "Verona"}')
    wire = [ChatMessage(role="user", content="Weather in Verona?"),
            ChatMessage(role="assistant", content="", tool_calls=[call]),
            ChatMessage(role="tool", content='{"sky": "clear"}', tool_call_id=call.id),
            ChatMessage(role="user", content="And tomorrow?")]
    text = chat_text(load_tokenizer(directory), [m.as_dict() for m in wire], [WEATHER.as_dict()])
    assert "The weather in a city." in text  # the tool, as the template writes it
    assert '"city": "Verona"' in text and "clear" in text  # the call and its result
    assert text.count("get_weather") >= 2


@pytest.mark.parametrize("fmt", OUTPUTS)
def test_each_familys_calls_are_read_whole_and_streamed(fmt):
    tool_plan = plan([{"name": "get_weather", "parameters": None}], "auto", True, fmt)
    content, calls = parse(OUTPUTS[fmt], tool_plan)
    assert content == CONTENT[fmt]
    assert [json.loads(c.arguments)["city"] for c in calls] == CALLS[fmt]
    assert {c.name for c in calls} == {"get_weather"} and len({c.id for c in calls}) == len(calls)
    reader = CallReader(tool_plan)
    events = [e for i in range(0, len(OUTPUTS[fmt]), 3) for e in reader.feed(OUTPUTS[fmt][i:i + 3])]
    events += reader.finish()
    assert "".join(e for e in events if isinstance(e, str)) == CONTENT[fmt]
    assert [e.name for e in events if isinstance(e, CallOpened)] == [c.name for c in calls]
    assert [(c.name, c.arguments) for c in reader.calls] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt", OUTPUTS)
def test_text_that_is_no_call_is_content(fmt):
    tool_plan = plan([{"name": "get_weather", "parameters": None}], "auto", True, fmt)
    for text in ("Fair Verona, where we lay our scene.", '{"not": "a call"}', "<tool_call>{broken"):
        assert parse(text, tool_plan) == (text, [])
        reader = CallReader(tool_plan)
        events = [e for i in range(0, len(text), 2) for e in reader.feed(text[i:i + 2])] + reader.finish()
        assert events and all(isinstance(e, str) for e in events) and "".join(events) == text


def test_mistral_call_ids_are_what_its_template_takes_and_its_newer_format_is_read():
    assert len(call_id("mistral")) == 9 and call_id("mistral").isalnum()
    tool_plan = plan([{"name": "get_weather", "parameters": None}], "auto", True, "mistral")
    _, calls = parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Verona"}', tool_plan)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Verona"})]


def test_required_and_named_choices_are_schemas_and_their_output_is_calls():
    tools = [{"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
             {"name": "b", "parameters": None}]
    required = plan(tools, "required", False, "hermes")
    assert required.schema["maxItems"] == 1 and len(required.schema["items"]["anyOf"]) == 2
    _, calls = parse('[{"name": "b", "parameters": {}}]', required)
    assert [(c.name, c.arguments) for c in calls] == [("b", "{}")]
    named = plan(tools, {"name": "a"}, True, "llama3_json")
    assert named.schema == tools[0]["parameters"]
    assert [(c.name, json.loads(c.arguments)) for c in parse('{"x": 3}', named)[1]] == [("a", {"x": 3})]
    assert parse("text", ToolPlan("none", "hermes")) == ("text", [])
