"""Tool calls: what a chat's `tool_choice` asks of the model, and the format its calls
come back in.

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

The calls are read out of the text, whole or as it streams, by `tool_call_reader`.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("llama3_json", "hermes", "mistral")
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
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
