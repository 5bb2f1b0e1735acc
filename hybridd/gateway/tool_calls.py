"""Tool calls: what a chat's `tool_choice` asks of the model, and the calls read back out
of its text, whole or as it streams.

`auto` leaves the model free and reads its calls in its own format, one parser per
template family (the `tool_call_parser` setting; `auto` tells the family from the chat
template): Llama 3.1's JSON (`{"name": ..., "parameters": {...}}`, after an optional
`<|python_tag|>`), Hermes' (Qwen2.5, Qwen3: `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, any number) and Mistral's (`[TOOL_CALLS][{"name": ..., "arguments":
{...}}]`, or `[TOOL_CALLS]name[ARGS]{...}` each). Text that does not parse as calls is
the answer's content. `required` and a named function are enforced through structured
output, whatever the template: `required` constrains the output to a JSON array of
`{"name", "parameters"}` among the tools (one call unless `parallel_tool_calls`), a named
function to its parameters' schema. `none` reads no calls (the tools are still written
into the prompt, as vLLM does).

A stream's text is held back from the moment it may be the start of a call (a marker,
or for Llama's format a first `{`); calls are sent whole, as one delta each, when the
sequence ends.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("llama3_json", "hermes", "mistral")
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
_ID_CHARS = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


def call_id(fmt: str) -> str:
    """A fresh call id; Mistral's templates take nine letters and digits, nothing else."""
    if fmt == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def template_format(model_path: str | Path) -> str:
    """The family of the model's chat template (tokenizer_config.json's `chat_template`,
    or chat_template.jinja): Mistral's, Hermes', else Llama 3.1's JSON."""
    path = Path(model_path)
    text = ""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template") or ""
        text = template if isinstance(template, str) else " ".join(t.get("template", "") for t in template)
    except (OSError, ValueError, AttributeError):
        pass
    if (path / "chat_template.jinja").is_file():
        text += (path / "chat_template.jinja").read_text(errors="replace")
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    return "llama3_json"


@dataclass
class ToolPlan:
    """What a request's tools and tool_choice ask: `mode` (none, auto, required, named), the
    named function, the constraint that enforces it (JSON Schema, as a map) and the format
    its calls come back in."""

    mode: str
    fmt: str
    function: str | None = None
    schema: dict[str, Any] | None = None
    names: frozenset[str] = field(default_factory=frozenset)

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"


def plan(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None, parallel: bool, fmt: str) -> ToolPlan:
    """The plan for OpenAI's `tools` (each {"name", "parameters"}) and `tool_choice`
    (validated by the caller: a named function is one of the tools)."""
    names = frozenset(tool["name"] for tool in tools)
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        name = choice["name"]
        parameters = next(tool.get("parameters") for tool in tools if tool["name"] == name)
        return ToolPlan("named", fmt, name, parameters or {"type": "object"}, names)
    if choice == "required":
        call = [{"type": "object", "properties": {"name": {"const": tool["name"]},
                                                  "parameters": tool.get("parameters") or {"type": "object"}},
                 "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", fmt, None, schema, names)
    return ToolPlan(choice, fmt, None, None, names)


def _objects(text: str) -> list[Any] | None:
    """The JSON values of `text`, one after another (separated by whitespace, `,` or `;`);
    None when it is not only that."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _calls(values: list[Any] | None, arguments_key: str, fmt: str) -> list[ToolCall] | None:
    """Calls from decoded JSON values (lists flattened): each an object with a string
    `name` and an object of arguments; None when any is not."""
    if not values:
        return None
    flat = [item for value in values for item in (value if isinstance(value, list) else [value])]
    calls = []
    for item in flat:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get(arguments_key, item.get("arguments", item.get("parameters", {})))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(call_id(fmt), item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def parse(text: str, tool_plan: ToolPlan) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output; calls only for a plan that reads them."""
    mode, fmt = tool_plan.mode, tool_plan.fmt
    if mode == "none":
        return text, []
    if mode == "named":
        try:
            arguments = json.loads(text)
        except ValueError:
            return text, []
        if not isinstance(arguments, dict):
            return text, []
        return "", [ToolCall(call_id(fmt), tool_plan.function or "", json.dumps(arguments, ensure_ascii=False))]
    if mode == "required":
        calls = _calls(_objects(text), "parameters", fmt)
        return ("", calls) if calls else (text, [])
    return _parse_auto(text, fmt)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_MISTRAL_ARGS = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")


def _parse_auto(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    if fmt == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        values = []
        for body in _HERMES.findall(text[start:]):
            parsed = _objects(body.strip())
            if parsed is None:
                return text, []
            values.extend(parsed)
        calls = _calls(values, "arguments", fmt)
        return (text[:start].strip(), calls) if calls else (text, [])
    if fmt == "mistral":
        start = text.find("[TOOL_CALLS]")
        rest = text[start + len("[TOOL_CALLS]"):] if start >= 0 else text.lstrip()
        if start < 0 and not rest.startswith("[{"):
            return text, []
        content = text[:start].strip() if start >= 0 else ""
        calls = _calls(_objects(rest), "arguments", fmt)
        if calls is None and _MISTRAL_ARGS.match(rest.strip()):  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            values = []
            for part in rest.split("[TOOL_CALLS]"):
                match = _MISTRAL_ARGS.match(part.strip())
                arguments = _objects(part.strip()[match.end():]) if match else None
                if not match or not arguments or len(arguments) != 1:
                    return text, []
                values.append({"name": match.group(1), "arguments": arguments[0]})
            calls = _calls(values, "arguments", fmt)
        return (content, calls) if calls else (text, [])
    stripped = text.strip()
    start = stripped.find("<|python_tag|>")
    body = stripped[start + len("<|python_tag|>"):] if start >= 0 else stripped
    if not body.lstrip().startswith("{"):
        return text, []
    calls = _calls(_objects(body), "parameters", fmt)
    return (stripped[:max(start, 0)].strip(), calls) if calls else (text, [])


class StreamedCalls:
    """One streamed sequence's text, split into the content sent at once and the calls
    sent when it ends."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.plan = tool_plan
        self.marker = _MARKERS[tool_plan.fmt]
        self.text = ""  # all of it
        self.sent = 0  # how much of it went out as content
        self.in_calls = tool_plan.mode in ("required", "named")  # all of a constrained output is calls

    def feed(self, text: str) -> str:
        """The content that may go out now, of `text` and what was held back before."""
        self.text += text
        if self.in_calls:
            return ""
        pending = self.text[self.sent:]
        at = pending.find(self.marker)
        if at >= 0:
            self.in_calls = True
            return self._send(pending[:at])
        if self.plan.fmt in ("llama3_json", "mistral") and not self.text[:self.sent].strip():
            opening = pending.lstrip()
            if not opening:
                return ""  # nothing but whitespace yet: it may open a call
            if opening.startswith("{" if self.plan.fmt == "llama3_json" else "[{") or (
                    self.plan.fmt == "mistral" and opening == "["):
                self.in_calls = True
                return ""
        # Hold back the longest end of the text that may begin the marker.
        keep = next((n for n in range(min(len(self.marker) - 1, len(pending)), 0, -1)
                     if self.marker.startswith(pending[-n:])), 0)
        return self._send(pending[:len(pending) - keep])

    def _send(self, content: str) -> str:
        self.sent += len(content)
        return content

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: content not sent yet, and the calls."""
        content, calls = parse(self.text, self.plan)
        if calls:
            already = self.text[:self.sent]
            return content[len(already):] if content.startswith(already) else "", calls
        return self.text[self.sent:], []
