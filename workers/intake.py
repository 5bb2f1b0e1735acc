"""The context generator's intake: the per-request work whose cost grows with what
a client sends, kept off the serving loop.

No vocabulary entry is longer than `longest_token_chars` characters, so a prompt
of more than `max_prompt_chars` = (max_model_len − 1) × that many characters has
at least max_model_len tokens and can never run. That bound is applied first and
costs nothing: `screen` reads a large frame's outline (byte counts, not text) and
refuses a prompt whose UTF-8 is over 4 bytes × max_prompt_chars, or token ids
numbering max_model_len or more, before the frame is decoded; `refusal` counts
the characters of a decoded prompt. Tokenizing what passes (seconds for the
longest prompts of a long-context model) runs on one thread of the intake's own,
with a tokenizer of its own and a lower CPU priority than the loop's, and a pipe
wakes the loop's poller when it is done;
the serving loop keeps its step cadence whatever arrives. A short prompt is the
exception (`encode_now`): handing it to the thread and back costs more than encoding
it (two thread wake-ups and a turn of the poller, a few hundred microseconds of its
time to first token on a busy host), so up to `INLINE_PROMPT_CHARS` characters are
encoded on the loop itself, with a tokenizer of the loop's own, within a budget of
`INLINE_TURN_CHARS` per turn of the loop (a burst of short prompts goes to the thread
beyond it). A prompt is encoded by
the tokenizer's Rust backend, which holds no GIL while it works, truncated to
max_model_len tokens (a prompt that long is refused anyway), so turning its ids
into Python objects takes little of the loop's GIL either. Characters are
Unicode code points (Python's `len`).
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

import msgspec

from hybridd.engine.prompt import chat_text, prompt_length_refusal
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.envelope import SUPPORTED_VERSIONS
from hybridd.protocol.limits import MAX_REQUEST_ID_CHARS

UTF8_MAX_BYTES_PER_CHAR = 4
# Envelope fields longer than this are left to the full decoding to judge.
_OUTLINE_FIELD_BYTES = 1024


class _Outline(msgspec.Struct):
    """The parts of a request the screen reads; every other field is skipped unread."""

    v: msgspec.Raw = msgspec.Raw()
    type: msgspec.Raw = msgspec.Raw()
    id: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    prompt_token_ids: msgspec.Raw = msgspec.Raw()


_OUTLINE = msgspec.msgpack.Decoder(_Outline)


def _small_value(raw: msgspec.Raw) -> Any:
    if not 0 < len(raw) <= _OUTLINE_FIELD_BYTES:
        return None
    try:
        return msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None


def _str_bytes(raw: msgspec.Raw) -> int | None:
    """The payload length of a msgpack str, from its header; None if not a str."""
    head = bytes(memoryview(raw)[:5])
    if not head:
        return None
    if 0xA0 <= head[0] <= 0xBF:
        return head[0] & 0x1F
    sizes = {0xD9: 1, 0xDA: 2, 0xDB: 4}
    width = sizes.get(head[0])
    return None if width is None or len(head) < 1 + width else int.from_bytes(head[1 : 1 + width], "big")


def _array_items(raw: msgspec.Raw) -> int | None:
    """The item count of a msgpack array, from its header; None if not an array."""
    head = bytes(memoryview(raw)[:5])
    if not head:
        return None
    if 0x90 <= head[0] <= 0x9F:
        return head[0] & 0x0F
    sizes = {0xDC: 2, 0xDD: 4}
    width = sizes.get(head[0])
    return None if width is None or len(head) < 1 + width else int.from_bytes(head[1 : 1 + width], "big")


# The intake's thread runs this many nice levels below the thread that starts it (the
# serving loop; at most Linux's lowest priority, 19): when the host has fewer free cores
# than runnable threads, the scheduler serves the loop and the model's threads first, so
# a client's long prompts take the CPU time the serving leaves, not the serving's time.
# Relative, so that a daemon started under `nice` keeps its intake below its loop.
INTAKE_NICENESS = 10
LOWEST_PRIORITY = 19


def intake_niceness(loop_niceness: int) -> int:
    """The intake thread's nice value beside a serving loop at `loop_niceness`."""
    return min(LOWEST_PRIORITY, loop_niceness + INTAKE_NICENESS)


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority below that of the thread it was started by,
    whose nice value it inherits (Linux: a nice value per thread)."""
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, intake_niceness(os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:  # a seccomp'd container may refuse it: the thread then runs at the loop's priority
        pass


# Prompts up to this many characters may be encoded on the loop (tens of microseconds
# each); a turn of the loop encodes at most INLINE_TURN_CHARS characters so.
INLINE_PROMPT_CHARS = 256
INLINE_TURN_CHARS = 1024


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def get_vocab(self) -> dict[str, int]: ...


def longest_token_chars(tokenizer: Encoder) -> int:
    """The most characters one token can stand for: the longest vocabulary entry
    (special tokens included). Byte-level vocabularies spell each byte as one
    character, so this bounds the bytes a token covers too."""
    return max((len(entry) for entry in tokenizer.get_vocab()), default=1) or 1


class Intake:
    def __init__(self, tokenizer: Encoder, max_model_len: int):
        # The process's one tokenizer: the loop detokenizes with it; the intake's thread
        # only renders chat templates with it (Python, no state of the Rust backend).
        self.tokenizer = tokenizer
        # Its fast path: a copy of the Rust backend that truncates, used to encode on both
        # threads (encoding borrows it immutably, so the two never wait on each other).
        self._backend = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(backend.to_str())
            self._backend.enable_truncation(max_length=max_model_len)
        self._inline_chars_left = INLINE_TURN_CHARS
        self.longest_token_chars = longest_token_chars(tokenizer)
        self.max_prompt_chars = max(max_model_len - 1, 1) * self.longest_token_chars
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="intake", initializer=_lower_priority)
        self._wake_lock = threading.Lock()  # no wake-up write after close (the fd could be reused)
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def refusal(self, prompt: str) -> str | None:
        """Why the prompt can never run, decided without tokenizing it; None if it may."""
        if len(prompt) <= self.max_prompt_chars:
            return None
        return (
            f"prompt: {len(prompt)} characters cannot fit the model's context of {self.max_model_len} tokens "
            f"(at most {self.max_prompt_chars} characters: max_model_len - 1 = {self.max_model_len - 1} tokens "
            f"of up to {self.longest_token_chars} characters each)"
        )

    def screen(self, frame: bytes) -> tuple[ProtocolError, int] | None:
        """Why a `generate` frame's prompt cannot fit, judged from byte counts without
        decoding the prompt's text or ids, with the version to answer in; None when it
        may fit or the frame is not a readable `generate` (the full decoding then says
        what is wrong)."""
        try:
            outline = _OUTLINE.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        request_id = _small_value(outline.id)
        version = _small_value(outline.v)
        if (
            type(version) is not int
            or version not in SUPPORTED_VERSIONS
            or _small_value(outline.type) != "generate"
            or not isinstance(request_id, str)
            or not 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS
        ):
            return None
        prompt_bytes = _str_bytes(outline.prompt)
        if prompt_bytes is not None and prompt_bytes > UTF8_MAX_BYTES_PER_CHAR * self.max_prompt_chars:
            return ProtocolError(
                ErrorCode.TOO_LARGE,
                f"prompt: {prompt_bytes} bytes of UTF-8 are more than {self.max_prompt_chars} characters "
                f"(max_prompt_chars) can be, at {UTF8_MAX_BYTES_PER_CHAR} bytes each; the model's context is "
                f"{self.max_model_len} tokens",
                field="prompt",
                request_id=request_id,
            ), version
        items = _array_items(outline.prompt_token_ids)
        if items is not None and (refusal := prompt_length_refusal(items, self.max_model_len)) is not None:
            return ProtocolError(
                ErrorCode.TOO_LARGE,
                f"prompt_token_ids: {refusal}",
                field="prompt_token_ids",
                request_id=request_id,
            ), version
        return None

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's token ids as the model's tokenizer gives them (special tokens
        included), or their first max_model_len: enough to tell that it is too long.
        Runs on the intake's thread."""
        if self._backend is None:
            return self.tokenizer.encode(prompt)
        return self._backend.encode_batch([prompt], add_special_tokens=True)[0].ids

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A chat's token ids as the model's chat template renders it with its tools (the
        first max_model_len at most); runs on the intake's thread. Raises PromptError."""
        text = chat_text(self.tokenizer, messages, tools)
        if self._backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def new_turn(self) -> None:
        """The loop starts a turn: `encode_now` has its whole budget again."""
        self._inline_chars_left = INLINE_TURN_CHARS

    def encode_now(self, prompt: str) -> list[int] | None:
        """A short prompt's ids (as `prompt_ids` gives them), encoded here on the
        loop's thread within this turn's budget; None when the prompt is longer than
        `INLINE_PROMPT_CHARS`, the turn's budget is spent, or no Rust tokenizer is at
        hand: it then goes to the intake's thread (`submit`)."""
        chars = len(prompt)
        if self._backend is None or chars > INLINE_PROMPT_CHARS or chars > self._inline_chars_left:
            return None
        self._inline_chars_left -= chars
        return self._backend.encode_batch([prompt], add_special_tokens=True)[0].ids

    def submit(self, job: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run `job(*args, **kwargs)` on the intake's thread (tokenizing: give it this
        intake's `tokenizer`); the poller's `fileno()` turns readable when it is done."""
        future = self._pool.submit(job, *args, **kwargs)
        future.add_done_callback(self._wake)
        return future

    def fileno(self) -> int:
        return self._wake_read

    def clear_wakeups(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _wake(self, _future: Future) -> None:
        with self._wake_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_write, b"\0")
            except BlockingIOError:  # a full pipe wakes the loop already
                pass

    def close(self) -> None:
        """Stop taking prompts; one being tokenized finishes on its thread, unread."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)
