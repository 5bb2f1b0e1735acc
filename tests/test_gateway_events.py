"""The streamed text chunk's event, written from pre-encoded halves, is byte for byte
what the generic writer makes of the same chunk object, for completions and chat,
with text that JSON must escape."""

from __future__ import annotations

import json

import pytest

from hybridd.gateway.openai_output import Reply, event

TEXTS = ["ROMEO:", "", 'quote " backslash \\ newline \n tab \t', "é ü 漢字 🙂", "\x00\x1f\u2028\u2029"]


def generic_delta(reply: Reply, index: int, text: str) -> bytes:
    if reply.chat:
        choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    return event(reply._object(".chunk", [choice], None))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_text_chunk_event_is_the_generic_writers(chat, text):
    reply = Reply(id="cmpl-0123abcd", model='tiny-"shakespeare"', chat=chat)
    for index in (0, 7, 123):
        fast = reply.delta(index, text)
        assert fast == generic_delta(reply, index, text)
        assert fast.startswith(b"data: ") and fast.endswith(b"\n\n")
        payload = json.loads(fast[6:])
        assert payload["choices"][0]["index"] == index
        assert (payload["choices"][0]["delta"]["content"] if chat else payload["choices"][0]["text"]) == text
