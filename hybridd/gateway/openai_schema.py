"""The OpenAI request bodies the gateway accepts, and how they become daemon requests.

Each body is a msgspec struct, decoded and checked in one pass of compiled code (it
is on every first token's path). A field the gateway does not use is ignored, as
vLLM ignores it, and named (a log line, the `X-Hybridd-Ignored-Fields` header) — unless
its value asks for something hybridd cannot do (`REFUSED_UNLESS`: tools, a JSON
response format, …), which is a 400 naming it. With `strict_openai` every field the
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
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),
    "functions": lambda v: v == [],
    "function_call": lambda v: v in ("none", "auto"),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "logit_bias": lambda v: v == {},
    "best_of": lambda v: v == 1,
    "suffix": lambda v: v == "",
    "guided_json": lambda v: False,
    "guided_regex": lambda v: False,
    "guided_choice": lambda v: False,
    "guided_grammar": lambda v: False,
    "structured_outputs": lambda v: False,
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
    # vLLM's: each prompt token's logprob with this many alternatives.
    prompt_logprobs: TopLogprobs | None = None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs: not supported with stream: true (they come with the whole answer)",
                              "prompt_logprobs")

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


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Body, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
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

    def sampling(self, default_max_tokens: int | None = None) -> dict[str, Any]:
        options = super().sampling(self.DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens)
        if self.max_completion_tokens is not None:
            options["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            options |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        return options

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {}) for m in self.messages]


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
