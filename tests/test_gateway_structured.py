"""Structured output and tools through the HTTP gateway against the real daemon (the
embedded model, its real workers), with the official `openai` package as the client:
documents that follow their schema for every seed, JSON objects, regexes, choices, tool
calls and their results, streamed and whole, and the errors that name what was bad."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk, ParsedChatCompletion

from tests.gateway_daemon import API_KEY, GatewayDaemon, run_daemon_with_gateway

MODEL = "tiny-shakespeare"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["merry", "sad", "wroth"]}, "sworn": {"type": "boolean"}},
    "required": ["name", "age", "mood", "sworn"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Verona", "Mantua"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
BELL = {"type": "function", "function": {"name": "ring_bell", "parameters": {
    "type": "object", "properties": {"times": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["times"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What weather shall we have in Verona?"}]


@pytest.fixture(scope="module")
def daemon() -> Iterator[GatewayDaemon]:
    with run_daemon_with_gateway() as running:
        yield running


@pytest.fixture(scope="module")
def oai(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _is_person(document) -> bool:
    return (isinstance(document, dict) and set(document) == set(PERSON["required"])
            and isinstance(document["name"], str) and len(document["name"]) <= 16
            and type(document["age"]) is int and 0 <= document["age"] <= 120
            and document["mood"] in ("merry", "sad", "wroth") and type(document["sworn"]) is bool)


def test_a_json_schema_answer_follows_its_schema_for_every_seed(oai):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(4):
        completion = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Who art thou?"}], response_format=response_format,
            seed=seed, temperature=1.0, n=2, max_tokens=120)
        for choice in completion.choices:
            assert choice.finish_reason == "stop", choice.message.content
            assert _is_person(json.loads(choice.message.content)), choice.message.content


def test_a_streamed_json_schema_answer_adds_up_to_a_valid_document(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Who art thou?"}], seed=11, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert _is_person(json.loads("".join(chunk.choices[0].delta.content or "" for chunk in chunks)))


def test_json_object_regex_and_choice(oai):
    for seed in range(3):
        answer = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Thy name?"}],
                                             response_format={"type": "json_object"}, seed=seed, max_tokens=200)
        choice = answer.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens: the beginning of an object
            assert choice.message.content.lstrip().startswith("{")
    regex = r"[0-9]{3}-[A-Z]{2}"
    completion = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20, seed=3,
                                        extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, completion.choices[0].text) and completion.choices[0].finish_reason == "stop"
    guided = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, guided.choices[0].text)
    for seed in range(3):
        chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Wilt thou?"}],
                                           seed=seed, extra_body={"guided_choice": ["ay", "nay", "perchance"]})
        assert chat.choices[0].message.content in ("ay", "nay", "perchance")


def _weather_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Verona", "Mantua") and 1 <= arguments["days"] <= 7, arguments
    return arguments


def test_a_required_tool_call_and_its_result_round_trip(oai):
    completion = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                             parallel_tool_calls=False, seed=5, max_tokens=80)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice.message
    call = choice.message.tool_calls[0]
    _weather_call(call)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    answer = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=12, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > completion.usage.prompt_tokens  # the call and its result were in the prompt


def _accumulated(stream) -> tuple[ParsedChatCompletion, list[ChatCompletionChunk]]:
    """The stream joined by the openai client's own accumulation, and its chunks."""
    state, chunks = ChatCompletionStreamState(), []
    for chunk in stream:
        state.handle_chunk(chunk)
        chunks.append(chunk)
    return state.get_final_completion(), chunks


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or ()]


def test_streamed_tool_calls_add_up_to_the_whole_answers_calls(oai):
    """Parallel calls (`required` lets a choice make several): each call's first delta has
    its index, id, type and name with empty arguments, the next ones its index and pieces of
    its arguments; joined, they are the whole answer's calls for the same seed, text for text."""
    request = {"model": MODEL, "messages": ASK, "tools": [WEATHER, BELL], "tool_choice": "required", "seed": 1,
               "n": 8, "max_tokens": 160}
    whole = oai.chat.completions.create(**request)
    streamed, chunks = _accumulated(oai.chat.completions.create(**request, stream=True,
                                                                stream_options={"include_usage": True}))
    assert [_calls(c.message) for c in streamed.choices] == [_calls(c.message) for c in whole.choices]
    assert max(len(c.message.tool_calls) for c in whole.choices) >= 2
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert _weather_call(call) if call.function.name == "get_weather" else json.loads(call.function.arguments)
        deltas = [call for chunk in chunks for c in chunk.choices if c.index == choice.index
                  for call in c.delta.tool_calls or ()]
        firsts = [next(d for d in deltas if d.index == i) for i in range(len(choice.message.tool_calls))]
        assert [(d.type, d.function.name, d.function.arguments) for d in firsts] == [
            ("function", call.function.name, "") for call in choice.message.tool_calls]
        assert len({d.id for d in firsts}) == len(firsts) and all(d.id for d in firsts)
        rest = [d for d in deltas if d not in firsts]
        assert all(d.id is None and d.function.name is None and d.function.arguments for d in rest)
        assert len(rest) > len(firsts)  # the arguments came in pieces
        assert sorted({d.index for d in deltas}) == list(range(len(firsts)))
        last = [c for chunk in chunks for c in chunk.choices if c.index == choice.index][-1]
        assert last.finish_reason == "tool_calls" and not any(
            c.delta.content for chunk in chunks for c in chunk.choices if c.index == choice.index)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert streamed.usage.completion_tokens == whole.usage.completion_tokens


def test_an_auto_answer_without_calls_streams_as_its_whole_content(oai):
    """The embedded model writes no calls of its own: under `auto` its text, held back
    where it might begin one, adds up to the whole answer's content."""
    request = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 24, "temperature": 0}
    whole = oai.chat.completions.create(**request)
    streamed, chunks = _accumulated(oai.chat.completions.create(**request, stream=True))
    assert whole.choices[0].message.content and whole.choices[0].message.tool_calls is None
    assert streamed.choices[0].message.content == whole.choices[0].message.content
    assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason in ("stop", "length")
    assert sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].delta.content) > 3  # as it came


def test_tool_choice_none_and_named(oai):
    plain = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                        max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"
    named = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[BELL, WEATHER], max_tokens=60, seed=2,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [_weather_call(call) for call in named.choices[0].message.tool_calls]
    assert named.choices[0].finish_reason == "tool_calls"
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[BELL, WEATHER], max_tokens=60, seed=2,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         stream=True)
    streamed, _ = _accumulated(stream)
    assert _calls(streamed.choices[0].message) == _calls(named.choices[0].message)
    assert streamed.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("request_fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
], ids=["bad-schema", "bad-regex", "bad-tool-schema", "unknown-tool", "two-constraints"])
def test_a_bad_constraint_is_a_400_naming_its_field(oai, request_fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **request_fields)
    assert caught.value.param == param and param in caught.value.message, caught.value.message
    assert oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices  # the daemon serves on
