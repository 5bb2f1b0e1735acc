"""A generate request's prompt as token ids: the text encoded, the ids as given, or a
chat's messages rendered by the model's own chat template.

This is the one place a chat template is applied (with the generation prompt, so the
model answers as the assistant). The rendered text carries its own special tokens
(a template writes `bos_token` itself), so it is encoded without adding them again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def prompt_length_refusal(num_tokens: int, max_model_len: int, *, at_least: bool = False) -> str | None:
    """Why a prompt of `num_tokens` tokens (`at_least`: of that many or more, when it was
    cut short while being counted) can never run, or None when it fits: the one rule
    every path that sees a prompt's length applies."""
    if num_tokens < max_model_len:
        return None
    count = f"has at least {num_tokens}" if at_least else f"{num_tokens}"
    return f"{count} tokens; max_model_len is {max_model_len} and at least one token must be generated"


class PromptError(ValueError):
    """The prompt cannot be turned into tokens; `field` names the request field at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def prompt_token_ids(
    tokenizer,
    *,
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    vocab_size: int,
) -> list[int]:
    """Exactly one of `prompt`, `token_ids` and `messages` is given (the wire checked it)."""
    if messages is not None:
        ids = chat_token_ids(tokenizer, messages)
        field = "messages"
    elif prompt is not None:
        ids = tokenizer.encode(prompt)
        field = "prompt"
    else:
        ids = list(token_ids or [])
        field = "prompt_token_ids"
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary of {vocab_size}", field)
    if not ids:
        raise PromptError("is empty once tokenized", field)
    return ids


def chat_token_ids(tokenizer, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None,
                   ) -> list[int]:
    """The chat rendered by the tokenizer's chat template, ready for the assistant's turn."""
    return tokenizer.encode(chat_text(tokenizer, messages, tools), add_special_tokens=False)


def chat_text(tokenizer, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """The chat as the tokenizer's chat template renders it, ending with the assistant's
    turn; its special tokens are in the text (encode it without adding them again).
    `tools` (OpenAI's function objects) are given to the template, which writes them in
    the model's own way; a message's `content` of None (a call's) is given as it is."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "the model has no chat template (`chat_template` in its tokenizer_config.json or a "
            "chat_template.jinja file); send a prompt instead", "messages")
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001  a template raises what it likes (raise_exception, TemplateError)
        raise PromptError(f"the model's chat template refused them: {exc}", "messages") from None
    return text
