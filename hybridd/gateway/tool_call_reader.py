"""Reading tool calls out of a model's text as it is generated: the content to send at
once, and each call as OpenAI streams it (opened with its id and name, then its
arguments' text piece by piece, as the model writes it).

One reader serves the whole answer too (`parse`: all the text fed at once), so a whole
answer's calls are the streamed ones joined: the same names, the same arguments text.

The reader decides as early as the text allows, and only on the text: content is sent
except what may still begin a call (a marker's first characters, and the whitespace
before it, which is dropped when a call follows). A call region (after a marker, or
for Llama's and Mistral's JSON a first `{` / `[` of the whole output) holds call objects
(`{"name": ..., "arguments" | "parameters": {...}}`, several, or a list of them) and for
Mistral's newer format `name[ARGS]{...}`. A call opens (is sent) once its name is read
and its arguments have begun (or its object closed without them, as `{}`); from then on
its arguments go out as they come, in json.dumps' form whatever the model's spacing
(`json_rewriter`; a JSON string of arguments is sent decoded, whole). A region that
breaks before any call opened (no JSON, no name, a name not a string, no region end) is
content after all, marker and all; after a call opened, the rest from the break on is
content. A call cut short (max_tokens) stays as far as it came.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from hybridd.gateway.json_rewriter import JsonRewriter
from hybridd.gateway.tool_calls import MARKERS, ToolCall, ToolPlan, call_id

_SEPARATORS = " \t\r\n,;"
_WHITESPACE = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_MISTRAL_ARGS = "[ARGS]"
_HERMES_END = "</tool_call>"
# Where a whole output's first non-blank character opens the calls without a marker.
_BARE_OPENERS = {"llama3_json": "{", "mistral": "["}


@dataclass(frozen=True)
class CallOpened:
    """A call begins: the first delta of its `index`, with its id and name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    """More of call `index`'s arguments text."""

    index: int
    text: str


Event = str | CallOpened | ArgumentsPiece  # a str is content


class _Broken(Exception):
    """The text in a call region is not what a call is written as."""


class _ValueScan:
    """Where one JSON value's text ends, found as its characters come: strings and
    containers by their quotes and nesting, a scalar at the next delimiter."""

    def __init__(self, first: str) -> None:
        self.kind = "string" if first == '"' else "container" if first in "{[" else "scalar"
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def advance(self, text: str, at: int, final: bool) -> int:
        """Scan from `at` (the value's first character on the first call); where it
        stopped: the value's end once `done`, else the end of `text`."""
        if self.kind == "scalar":
            end = at
            while end < len(text) and text[end] not in ",}]" + _WHITESPACE:
                end += 1
            self.done = end < len(text) or final
            return end
        for i in range(at, len(text)):
            char = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


@dataclass
class _Call:
    """The call being read: what is known of it so far."""

    start: int  # where its text began
    name: str | None = None
    arguments: str = ""  # its arguments' text read so far (rewritten)
    rewriter: JsonRewriter = field(default_factory=JsonRewriter)
    arguments_kind: str = ""  # "{", '"' once they began
    arguments_done: bool = False
    expect: str = "key_or_end"  # in its object: key_or_end, key, colon, value, next
    key: str = ""
    scan: _ValueScan | None = None
    scan_from: int = 0
    ends_with_arguments: bool = False  # no object around it: the named function's, Mistral's name[ARGS]
    index: int | None = None  # once opened
    sent: int = 0  # how much of `arguments` went out


class CallReader:
    """One sequence's text, read into content and calls as it comes (`feed`, then
    `finish` at its end), per the request's tool plan."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.plan = tool_plan
        auto = tool_plan.mode == "auto"
        self.marker = MARKERS[tool_plan.fmt] if auto else ""
        self.bare = _BARE_OPENERS.get(tool_plan.fmt, "") if auto else ""
        self.calls: list[ToolCall] = []
        self.text = ""
        self.at = 0  # where reading goes on
        self.sent = 0  # the content before this is sent (or dropped)
        self.final = False
        self.events: list[Event] = []
        self.state = "text"
        # The call region being read: where reading goes on as content if it breaks before a call opened.
        self.resume = 0
        self.opened_in_region = False
        self.list_open = False
        self.call: _Call | None = None
        if tool_plan.mode in ("required", "named"):  # the whole output is calls
            self._open_region(0, 0)

    def feed(self, text: str) -> list[Event]:
        """What may go out now, given `text` after what came before."""
        self.text += text
        return self._read()

    def finish(self) -> list[Event]:
        """What is left at the sequence's end."""
        self.final = True
        return self._read()

    def _read(self) -> list[Event]:
        self.events = []
        if self.plan.mode == "none":
            self._content(len(self.text))
            return self.events
        while self._step():
            pass
        return self.events

    def _step(self) -> bool:
        """One move of the reader; False when it waits for more text."""
        try:
            if self.state == "text":
                return self._text()
            if self.call is not None:
                return self._read_call(self.call)
            return self._items()
        except _Broken:
            call = self.call
            self._break(call.start if call is not None and call.index is None else self.at)
            return True

    # ------------------------------------------------------------ content

    def _content(self, end: int) -> None:
        if end > self.sent:
            self.events.append(self.text[self.sent:end])
            self.sent = end

    def _before_blanks(self, end: int) -> int:
        """`end`, less the whitespace just before it (never back past what was sent)."""
        return self.sent + len(self.text[self.sent:end].rstrip())

    def _text(self) -> bool:
        text = self.text
        if self.bare:
            first = len(text) - len(text[self.at:].lstrip())
            if first == len(text) and not self.final:
                return False  # only whitespace yet: it may still open calls
            opens = first < len(text) and text[first] == self.bare
            self.bare = ""  # only the output's first character may
            if opens:
                self._open_region(first, first + 1)
                return True
        if self.marker:
            found = text.find(self.marker, self.at)
            if found >= 0:
                self._content(self._before_blanks(found))
                self._open_region(found + len(self.marker), found + len(self.marker))
                return True
        if self.final:
            self._content(self._before_blanks(len(text)) if self.calls else len(text))
            self.at = len(text)
            return False
        # Hold back what may begin a marker, and the whitespace before it.
        held = _marker_prefix(text, max(self.at, self.sent), self.marker)
        self._content(self._before_blanks(len(text) - held))
        self.at = max(self.at, self.sent)
        return False

    # ------------------------------------------------------------ call regions

    def _open_region(self, at: int, resume: int) -> None:
        self.state = "region"
        self.at, self.resume = at, resume
        self.opened_in_region = False
        self.list_open = False
        self.call = None

    def _close_region(self) -> None:
        if not self.opened_in_region:
            raise _Broken
        self.state = "text"
        self.sent = self.at
        self.call = None

    def _break(self, at: int) -> None:
        """The region is no calls from `at` on: before any call opened, the whole region
        is content; after one, the text from `at`."""
        self.call = None
        self.state = "text"
        if self.opened_in_region:
            self.at = self.sent = at
        else:
            self.at = self.resume

    def _skip(self, chars: str) -> bool:
        """Past `chars`; whether any text is left to read."""
        while self.at < len(self.text) and self.text[self.at] in chars:
            self.at += 1
        return self.at < len(self.text)

    def _past(self, word: str) -> bool | None:
        """At `word`: True (and past it); the text ends inside it: None; else False."""
        rest = self.text[self.at:self.at + len(word)]
        if rest == word:
            self.at += len(word)
            return True
        if word.startswith(rest) and not self.final:
            return None
        return False

    def _items(self) -> bool:
        """Between a region's calls: separators, a list's brackets, a call, the region's end."""
        fmt, named = self.plan.fmt, self.plan.mode == "named"
        if not self._skip(_WHITESPACE if named else _SEPARATORS):
            if not self.final:
                return False
            self._close_region()
            return True
        char = self.text[self.at]
        if named:
            if self.opened_in_region:
                self._close_region()  # after the arguments: content
            elif char == "{":
                self.call = _Call(self.at, name=self.plan.function or "", expect="value", key="arguments",
                                  ends_with_arguments=True)
            else:
                raise _Broken
            return True
        ends = _HERMES_END if fmt == "hermes" else self.marker if fmt == "mistral" else ""
        if ends and char == ends[0]:
            seen = self._past(ends)
            if seen is None:
                return False
            if seen:
                if ends == _HERMES_END:
                    self._close_region()
                return True  # Mistral: [TOOL_CALLS] before each name[ARGS]{...}
        if char == "[" and not self.list_open:
            self.list_open = True
            self.at += 1
        elif char == "]" and self.list_open:
            self.list_open = False
            self.at += 1
        elif char == "{":
            self.call = _Call(self.at)
            self.at += 1
        elif fmt == "mistral" and self.marker and not self.list_open and _MISTRAL_NAME.match(char):
            self.call = _Call(self.at, expect="name[ARGS]", ends_with_arguments=True)
        elif self.opened_in_region:
            self._close_region()  # what follows the calls is content
        else:
            raise _Broken
        return True

    # ------------------------------------------------------------ one call

    def _read_call(self, call: _Call) -> bool:
        if call.scan is not None:
            return self._scan_value(call)
        if call.expect == "name[ARGS]":
            match = _MISTRAL_NAME.match(self.text, self.at)
            assert match is not None
            if match.end() == len(self.text) and not self.final:
                return False
            self.at = match.end()
            seen = self._past(_MISTRAL_ARGS)
            if seen is None:
                self.at = match.start()
                return False
            if not seen:
                raise _Broken
            call.name, call.expect, call.key = match.group(), "value", "arguments"
            return True
        if not self._skip(_WHITESPACE):
            return self._cut(call)
        char = self.text[self.at]
        if call.expect in ("key_or_end", "key"):
            if char == "}" and call.expect == "key_or_end":
                return self._close_call(call)
            if char != '"':
                raise _Broken
        elif call.expect in ("colon", "next"):
            if call.expect == "next" and char == "}":
                return self._close_call(call)
            if char != (":" if call.expect == "colon" else ","):
                raise _Broken
            call.expect = "value" if call.expect == "colon" else "key"
            self.at += 1
            return True
        elif call.key == "name" and call.name is None and char != '"':
            raise _Broken
        elif call.key in _ARGUMENT_KEYS and not call.arguments_kind:
            if char not in '{"':
                raise _Broken
            call.arguments_kind = char
            self._open(call)
        call.scan, call.scan_from = _ValueScan(char), self.at
        return True

    def _scan_value(self, call: _Call) -> bool:
        """Read on in a key or value; the arguments go out as they come once the call opened."""
        scan = call.scan
        assert scan is not None
        end = scan.advance(self.text, self.at, self.final)
        in_arguments = call.expect == "value" and call.key in _ARGUMENT_KEYS and not call.arguments_done
        if in_arguments and call.arguments_kind == "{":
            call.arguments += call.rewriter.feed(self.text[self.at:end])
            self._send_arguments(call)
        self.at = end
        if not scan.done:
            return self._cut(call)
        value = self.text[call.scan_from:end]
        call.scan = None
        if call.expect in ("key_or_end", "key"):
            call.key, call.expect = str(_decoded(value, str)), "colon"
            return True
        call.expect = "next"
        if in_arguments:
            if call.arguments_kind == '"':
                decoded = str(_decoded(value, str))
                _decoded(decoded, dict)
                call.arguments = call.rewriter.feed(decoded)
            call.arguments_done = True
            self._open(call)
        elif call.key == "name" and call.name is None:
            call.name = str(_decoded(value, str))
            self._open(call)
        elif scan.kind == "scalar":
            _decoded(value, object)
        if call.ends_with_arguments and call.arguments_done:
            self.call = None
        return True

    def _cut(self, call: _Call) -> bool:
        """The text ends inside a call: wait for more; at the sequence's end a call that
        opened stays as far as it came, one that did not is no call."""
        if not self.final:
            return False
        if call.index is None:
            raise _Broken
        call.arguments += call.rewriter.finish()
        self._send_arguments(call)
        self._close_region()
        return True

    def _close_call(self, call: _Call) -> bool:
        if call.name is None:
            raise _Broken
        self.at += 1
        if not call.arguments_kind:
            call.arguments, call.arguments_done = "{}", True
        self._open(call)
        self.call = None
        return True

    def _open(self, call: _Call) -> None:
        """Send the call's first delta once its name is read and its arguments began."""
        if call.index is None and call.name is not None and (call.arguments_kind == "{" or call.arguments_done):
            call.index = len(self.calls)
            self.calls.append(ToolCall(call_id(self.plan.fmt), call.name, ""))
            self.opened_in_region = True
            self.events.append(CallOpened(call.index, self.calls[-1].id, call.name))
        self._send_arguments(call)

    def _send_arguments(self, call: _Call) -> None:
        if call.index is not None and len(call.arguments) > call.sent:
            self.events.append(ArgumentsPiece(call.index, call.arguments[call.sent:]))
            call.sent = len(call.arguments)
            self.calls[call.index].arguments = call.arguments


def _decoded(text: str, kind: type) -> object:
    try:
        value = json.loads(text)
    except ValueError:
        raise _Broken from None
    if not isinstance(value, kind):
        raise _Broken
    return value


def _marker_prefix(text: str, start: int, marker: str) -> int:
    """How many of `text`'s last characters (from `start` on) may begin `marker`."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse(text: str, tool_plan: ToolPlan) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output: the reader fed it at once."""
    reader = CallReader(tool_plan)
    events = reader.feed(text) + reader.finish()
    return "".join(event for event in events if isinstance(event, str)), reader.calls
