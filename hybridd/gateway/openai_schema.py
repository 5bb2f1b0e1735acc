"""The OpenAI request bodies the gateway accepts, and how they become daemon requests.

Each body is a msgspec struct, decoded and checked in one pass of compiled code (it
is on every first token's path). A field the gateway does not use is ignored, as
vLLM ignores it, and named (a log line, the `X-Hybridd-Ignored-Fields` header) — unless
its value asks for something hybridd cannot do (`REFUSED_UNLESS`: the legacy `functions`,
`logit_bias`, …), which is a 400 naming it. With `strict_openai` every field the
gateway does not use is refused (a JSON `null` counts as absent). The value ranges of the sampling
fields are the daemon's own (`hybridd.protocol`): the SDK checks them before sending
and its error names the field, which becomes OpenAI's `param`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from hybridd.gateway.errors import GatewayError, bad_request
from hybridd.protocol.limits import MAX_CACHE_SALT_CHARS, MAX_N, MAX_TOKENS_CAP, MAX_TOP_LOGPROBS

# Fields the gateway does not use, each with the test that its value asks for nothing
# (then it is ignored); any other value asks for what hybridd cannot do yet: a 400.
REFUSED_UNLESS: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v in ("none", "auto"),
    "logit_bias": lambda v: v == {},
    "best_of": lambda v: v == 1,
    "suffix": lambda v: v == "",
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
}
# Accepted and ignored even by strict_openai: they only label the request on OpenAI's side.
NO_OP_FIELDS = frozenset({"user"})
MAX_PROMPTS = 64

Positive = Annotated[int, msgspec.Meta(ge=1)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: one constraint."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by completions and chat completions."""

    SAMPLING: ClassVar[tuple[str, ...]] = (
        "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "ignore_eos",
    )
    FIELDS: ClassVar[frozenset[str]]  # the body's known fields (set below each class)

    model: str
    max_tokens: Positive | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Requests share prefix-cache blocks only under the same salt (vLLM's field).
    cache_salt: CacheSalt | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # An extension: false turns speculative decoding off for this request (nil: the daemon's setting).
    speculative: bool | None = None
    # vLLM's: each prompt token's logprob with this many alternatives.
    prompt_logprobs: TopLogprobs | None = None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs: not supported with stream: true (they come with the whole answer)",
                              "prompt_logprobs")
        self.structured()

    def structured(self) -> tuple[dict[str, Any], str] | None:
        """The constraint asked for (`sampling.structured` on the wire) and the body field that
        asked, or None; two fields that ask are a 400."""
        asked: list[tuple[dict[str, Any], str]] = []
        if self.response_format is not None and self.response_format.type != "text":
            form = self.response_format
            if form.type == "json_object":
                asked.append(({"json_object": True}, "response_format"))
            else:
                if form.json_schema is None or form.json_schema.schema is None:
                    raise bad_request("response_format.json_schema.schema: a json_schema response format needs "
                                      "its schema", "response_format")
                asked.append(({"json": _json_text(form.json_schema.schema)}, "response_format"))
        if (given := self.structured_outputs) is not None:
            kinds = [({"json": _json_text(given.json)}, "json") if given.json is not None else None,
                     ({"regex": given.regex}, "regex") if given.regex is not None else None,
                     ({"grammar": given.grammar}, "grammar") if given.grammar is not None else None,
                     ({"choice": given.choice}, "choice") if given.choice is not None else None,
                     ({"json_object": True}, "json_object") if given.json_object else None]
            kinds = [kind for kind in kinds if kind is not None]
            if len(kinds) != 1:
                raise bad_request("structured_outputs: give exactly one of json, regex, grammar, choice and "
                                  "json_object", "structured_outputs")
            asked.append((kinds[0][0], "structured_outputs"))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                          ("guided_choice", "choice")):
            if (value := getattr(self, name)) is not None:
                asked.append(({key: _json_text(value) if key == "json" else value}, name))
        if len(asked) > 1:
            names = ", ".join(name for _, name in asked)
            raise bad_request(f"{asked[1][1]}: give one structured output, not several ({names})", asked[1][1])
        return asked[0] if asked else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """The SDK's sampling keywords (only those given, so the daemon's defaults apply)."""
        options: dict[str, Any] = {name: value for name in self.SAMPLING if (value := getattr(self, name)) is not None}
        options["max_tokens"] = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if self.stop is not None:
            options["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.n > 1:
            options["n"] = self.n
        if (structured := self.structured()) is not None:
            options["structured"] = structured[0]
        if self.prompt_logprobs is not None:
            options["prompt_logprobs"] = self.prompt_logprobs
        return options


class CompletionRequest(_Body, kw_only=True):
    """`POST /v1/completions`."""

    # A string, strings, token ids, or lists of token ids: told apart in `prompts`
    # (one struct field cannot be a union of several array types).
    prompt: str | list[Any]
    logprobs: TopLogprobs | None = None
    echo: bool = False
    DEFAULT_MAX_TOKENS: ClassVar[int] = 16  # OpenAI's default for completions

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[str | list[int]] = [prompt]
        else:
            try:  # checked by msgspec's compiled code: a prompt can hold many thousands of ids
                if prompt and type(prompt[0]) is int:
                    prompts = [msgspec.convert(prompt, list[int])]
                else:
                    prompts = msgspec.convert(prompt, list[str | list[int]])
            except msgspec.ValidationError:
                raise bad_request("prompt: give a string, a list of strings, a list of token ids or a list of "
                                  "lists of token ids", "prompt") from None
        if not prompts:
            raise bad_request("prompt: no prompt given", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
        if self.echo and any(not isinstance(p, str) for p in prompts):
            raise bad_request("echo: only supported with text prompts (the gateway holds no tokenizer)", "echo")
        if self.echo and self.logprobs is not None and self.stream:
            raise bad_request("echo: not supported with logprobs and stream: true (the prompt's logprobs come with "
                              "the whole answer)", "echo")
        return prompts

    def sampling(self, default_max_tokens: int | None = None) -> dict[str, Any]:
        options = super().sampling(self.DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens)
        if self.logprobs is not None:  # the sampled token's logprob and this many alternatives
            options |= {"logprobs": True, "top_logprobs": self.logprobs}
            if self.echo:  # the echoed prompt's tokens come with theirs
                options["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return options


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # the call a tool message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls always follow the parameters under tool_choice required or named


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Body, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    # Chat has no length default at OpenAI: the answer runs to its end or the context's.
    DEFAULT_MAX_TOKENS: ClassVar[int] = MAX_TOKENS_CAP

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise bad_request("tool_choice: a tool choice other than none or auto needs tools", "tool_choice")
        names = {t.function.name for t in self.tools or ()}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice: no tool is named {choice.function.name!r}", "tool_choice")
        if choice not in (None, "none", "auto") and self.structured() is not None:
            raise bad_request(f"tool_choice: {'a named function' if isinstance(choice, NamedToolChoice) else choice} "
                              "is enforced with structured output; give no other", "tool_choice")

    def sampling(self, default_max_tokens: int | None = None) -> dict[str, Any]:
        options = super().sampling(self.DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens)
        if self.max_completion_tokens is not None:
            options["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            options |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        return options

    def chat_messages(self) -> list[dict[str, Any]]:
        messages = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                         for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tools as the wire's `ToolSpec`s (the parameters' schema as JSON text)."""
        if not self.tools:
            return None
        return [{"name": t.function.name, "description": t.function.description,
                 "parameters": None if t.function.parameters is None else _json_text(t.function.parameters)}
                for t in self.tools]

    def tool_choice_value(self) -> str | dict[str, str] | None:
        choice = self.tool_choice
        return {"name": choice.function.name} if isinstance(choice, NamedToolChoice) else choice


def _json_text(value: dict[str, Any] | str | Any) -> str:
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


CompletionRequest.FIELDS = frozenset(CompletionRequest.__struct_fields__)
ChatCompletionRequest.FIELDS = frozenset(ChatCompletionRequest.__struct_fields__)
# One typed pass from the body's bytes for a body that is right (every first token's
# case); any failure is diagnosed again from the decoded map.
_DECODERS = {model: msgspec.json.Decoder(model) for model in (CompletionRequest, ChatCompletionRequest)}

# msgspec's error ends with where it happened: " - at `$.messages[0].role`".
_WHERE = re.compile(r" - at `\$\.?([A-Za-z_][A-Za-z0-9_]*)?[^`]*`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def parse_body(model: type[_Body], raw: bytes | bytearray, *, strict: bool = False) -> tuple[Any, list[str]]:
    """Decode and check a JSON body: the request and the names of the fields ignored. A
    failure is a 400 naming the first offending field, and every unsupported field at once."""
    try:
        request, ignored = _DECODERS[model].decode(raw), []
    except msgspec.MsgspecError:
        request, ignored = _diagnose(model, raw, strict)
    request.check_supported()
    return request, ignored


def _diagnose(model: type[_Body], raw: bytes | bytearray, strict: bool) -> tuple[Any, list[str]]:
    """The slow path: the body as a map, its fields the gateway does not use (a JSON `null`
    counts as absent), then its values; returns the request and the fields ignored."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as error:
        raise GatewayError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unused = sorted(k for k in body.keys() - model.FIELDS if body[k] is not None and k not in NO_OP_FIELDS)
    refused = [k for k in unused if strict or not REFUSED_UNLESS.get(k, lambda v: True)(body[k])]
    if refused:
        names = ", ".join(refused)
        raise bad_request(f"unsupported field(s): {names}; hybridd does not implement them", refused[0],
                          code="unsupported_field")
    for unknown in body.keys() - model.FIELDS:
        del body[unknown]
    try:
        return msgspec.convert(body, model), unused
    except msgspec.ValidationError as error:
        raise _invalid(str(error)) from None


def _invalid(message: str) -> GatewayError:
    where = _WHERE.search(message)
    param = where.group(1) if where else None
    if param is None and (missing := _MISSING.match(message)):
        param = missing.group(1)
    text = message[:where.start()] if where else message
    return GatewayError(400, f"{param or 'body'}: {text}", param=param)
