"""The tool-call reader fed a model's text token by token, in each template family's
format: content before a call goes out as it comes, what may begin a marker is held
back (a marker split across tokens never leaks), each call opens with its index, id and
name and its arguments follow in pieces, parallel calls take indices 0, 1, and a
malformed call is content. Every way of cutting the text reads the same as the whole."""

from __future__ import annotations

import json
import re

import pytest

from hybridd.gateway.tool_call_reader import ArgumentsPiece, CallOpened, CallReader, Event, parse
from hybridd.gateway.tool_calls import plan

TOOLS = [{"name": "get_weather", "parameters": None}, {"name": "ring_bell", "parameters": None}]
WEATHER = {"city": "Verona", "days": 3}
BELL = {"times": 2}
# Each family's text before two calls (get_weather, ring_bell), as its models write them.
TWO_CALLS = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Verona", "days": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "ring_bell", "arguments": {"times": 2}}\n</tool_call>',
    "llama3_json": 'Let me look. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Verona", "days": 3}}; '
                   '{"name": "ring_bell", "parameters": {"times": 2}}',
    "mistral": 'Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Verona", "days": 3}}, '
               '{"name": "ring_bell", "arguments": {"times": 2}}]',
}
MALFORMED = {
    "hermes": ['Well <tool_call>{"name": get_weather}</tool_call>', "<tool_call>{broken", "<tool_call></tool_call>"],
    "llama3_json": ['{"name": "get_weather", "parameters": [1]}', "<|python_tag|>{oops", '{"city": "Verona"}'],
    "mistral": ["[TOOL_CALLS] not json", '[TOOL_CALLS]get_weather{"city": 1}', "[Note] fair Verona"],
}


def tokens(text: str) -> list[str]:
    """The text cut as a BPE tokenizer would, roughly: words and runs of punctuation,
    each with the whitespace before it (so markers fall into several tokens)."""
    pieces = re.findall(r"\s*\w+|\s*[^\w\s]+|\s+", text)
    assert "".join(pieces) == text
    return pieces


def read(fmt: str, pieces: list[str], choice: str | dict = "auto") -> tuple[list[list[Event]], CallReader]:
    reader = CallReader(plan(TOOLS, choice, True, fmt))
    return [reader.feed(piece) for piece in pieces] + [reader.finish()], reader


def joined(events: list[Event]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the (name, arguments) of each call that the events add up to,
    checking their order: a call's first event opens it, at the next index."""
    content, calls = "", []
    for item in events:
        if isinstance(item, str):
            content += item
        elif isinstance(item, CallOpened):
            assert item.index == len(calls) and item.id
            calls.append((item.name, ""))
        else:
            assert isinstance(item, ArgumentsPiece) and item.index < len(calls)
            calls[item.index] = (calls[item.index][0], calls[item.index][1] + item.text)
    return content, calls


def test_the_tokens_cut_each_marker():
    for fmt, text in TWO_CALLS.items():
        marker = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}[fmt]
        assert marker in text and not any(marker in piece for piece in tokens(text))


@pytest.mark.parametrize("fmt", TWO_CALLS)
def test_two_calls_after_text_stream_as_openai_deltas(fmt):
    text = TWO_CALLS[fmt]
    per_token, reader = read(fmt, tokens(text))
    events = [item for step in per_token for item in step]
    content, calls = joined(events)
    assert content == "Let me look."
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_weather", WEATHER),
                                                                           ("ring_bell", BELL)]
    assert [(call.name, call.arguments) for call in reader.calls] == calls
    # The content went out before the marker was whole; nothing of the marker leaked.
    marker_done = next(i for i in range(len(per_token)) if any(isinstance(e, CallOpened) for e in per_token[i]))
    assert "".join(e for step in per_token[:marker_done] for e in step if isinstance(e, str)) == "Let me look."
    assert per_token[0] == ["Let"]
    # Each call opened before its arguments were whole, which then came in several pieces.
    pieces = [e for e in events if isinstance(e, ArgumentsPiece) and e.index == 0]
    assert len(pieces) > 3 and events.index(next(e for e in events if isinstance(e, CallOpened))) < \
        events.index(pieces[0])
    # The whole output reads the same.
    whole_content, whole_calls = parse(text, plan(TOOLS, "auto", True, fmt))
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)


@pytest.mark.parametrize("fmt", TWO_CALLS)
def test_every_cut_reads_as_the_whole_text(fmt):
    """Cut in two anywhere (a marker across the cut among them), or one character at a time."""
    text = TWO_CALLS[fmt]
    steps, _ = read(fmt, [text])
    whole = joined(steps[0] + steps[1])
    for cut in range(len(text) + 1):
        per_token, _ = read(fmt, [text[:cut], text[cut:]])
        assert joined([e for step in per_token for e in step]) == whole, cut
    per_char, _ = read(fmt, list(text))
    assert joined([e for step in per_char for e in step]) == whole


@pytest.mark.parametrize("fmt", MALFORMED)
def test_a_malformed_call_is_content(fmt):
    for text in MALFORMED[fmt]:
        per_token, reader = read(fmt, tokens(text))
        assert joined([e for step in per_token for e in step]) == (text, []), text
        assert reader.calls == [] and parse(text, plan(TOOLS, "auto", True, fmt)) == (text, [])


@pytest.mark.parametrize("fmt", TWO_CALLS)
def test_text_that_only_looks_like_a_marker_goes_out(fmt):
    marker = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}[fmt]
    text = f"Say {marker[:-1]} and more"
    per_token, _ = read(fmt, tokens(text))
    assert joined([e for step in per_token for e in step]) == (text, [])
    assert "".join(e for e in per_token[-2] if isinstance(e, str))  # out before the sequence ended


def test_mistrals_name_args_calls_and_a_call_cut_short():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Verona", "days": 3}[TOOL_CALLS]ring_bell[ARGS]{"times": 2}'
    per_token, _ = read("mistral", tokens(text))
    assert joined([e for step in per_token for e in step]) == (
        "", [("get_weather", json.dumps(WEATHER)), ("ring_bell", json.dumps(BELL))])
    # max_tokens ends a call midway: it stays as far as it came, whole or streamed alike.
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Ver'
    per_token, _ = read("hermes", tokens(cut))
    assert joined([e for step in per_token for e in step]) == ("", [("get_weather", '{"city": "Ver')])


def test_required_and_named_outputs_are_calls_from_their_first_character():
    required = '[{"name": "ring_bell", "parameters": {"times": 1}}, {"name": "get_weather", "parameters": {}}]'
    per_token, _ = read("hermes", tokens(required), "required")
    assert joined([e for step in per_token for e in step]) == ("", [("ring_bell", '{"times": 1}'),
                                                                    ("get_weather", "{}")])
    named = '{"city": "Mantua", "days": 7}'
    per_token, _ = read("llama3_json", tokens(named), {"name": "get_weather"})
    assert isinstance(per_token[0][0], CallOpened)  # opened at the first token
    assert joined([e for step in per_token for e in step]) == ("", [("get_weather", named)])
