"""Every limit of the wire protocol, defined once.

The codec, the validators, the channels and SPEC.md all read these names; a limit
changes here and nowhere else.
"""

from __future__ import annotations

from typing import Final

# The major version carried in every message's `v` field: the newest is written by
# default, and every version from the oldest up is still accepted. Messages with any
# other value are rejected with `unsupported_version`.
PROTOCOL_VERSION: Final = 4
OLDEST_PROTOCOL_VERSION: Final = 1

# One encoded message (one ZeroMQ frame). Enforced twice: by ZeroMQ's MAXMSGSIZE on
# every socket (a peer that sends more is disconnected) and by the codec before
# unpacking (for frames that arrive through other paths).
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024

# Request fields.
MAX_REQUEST_ID_CHARS: Final = 128
MAX_PROMPT_CHARS: Final = 1_048_576
MAX_PROMPT_TOKEN_IDS: Final = 262_144
MAX_STOP_STRINGS: Final = 16
MAX_STOP_STRING_CHARS: Final = 256
MAX_STOP_TOKEN_IDS: Final = 64
MAX_TOKENS_CAP: Final = 65_536
MAX_TIMEOUT_S: Final = 3600.0
MAX_TOKEN_ID: Final = 2**31 - 1
MAX_SEED: Final = 2**63 - 1
# OpenAI-compatible range for presence/frequency penalties.
MAX_ABS_PENALTY: Final = 2.0
MAX_ERROR_MESSAGE_CHARS: Final = 4096
# A request's prefix-cache salt (version 3).
MAX_CACHE_SALT_CHARS: Final = 256
# Chat requests (version 2): the messages a chat may hold, the length of a role or a
# speaker's name; the contents together count against MAX_PROMPT_CHARS.
MAX_CHAT_MESSAGES: Final = 1024
MAX_CHAT_ROLE_CHARS: Final = 64
# Sequences per request (`n`), and alternatives per token (`top_logprobs`, as OpenAI).
MAX_N: Final = 16
MAX_TOP_LOGPROBS: Final = 20
# A non-streaming request's final reply carries every token's logprobs: the entries
# (n x max_tokens x (1 + top_logprobs)) are bounded so that it fits one message.
# Streaming requests carry them in their chunks and have no such bound.
MAX_FINAL_LOGPROB_ENTRIES: Final = 32_768

# msgpack unpacker limits: a backstop against absurd values, set above the field
# limits so that a value just over a field limit is still reported with its field
# name. Strings may be as long as a whole message (prompts are counted in characters
# after decoding, up to 4 bytes each in UTF-8); arrays twice the longest legal list
# (prompt token ids); maps stay small (status and the arena manifest are the
# largest); bin only carries IPC handles; no ext types at all.
UNPACK_MAX_STR_LEN: Final = MAX_MESSAGE_BYTES
UNPACK_MAX_BIN_LEN: Final = 65_536
UNPACK_MAX_ARRAY_LEN: Final = 2 * MAX_PROMPT_TOKEN_IDS
UNPACK_MAX_MAP_LEN: Final = 4096
UNPACK_MAX_EXT_LEN: Final = 0

# Replies per session that the transport would not take (the client is not reading
# and its queue of CLIENT_SEND_HWM frames is full) and that wait in the session's
# outbox. Past this the session's generate requests end with `overloaded`; past
# twice this the session is abandoned as if it had disconnected.
SESSION_BACKLOG_LIMIT: Final = 1024

# Reply rings (`attach_ring`): the bytes of one ring's memory, header included. How many
# the daemon keeps attached at once is its `max_reply_rings` setting.
MIN_REPLY_RING_BYTES: Final = 64 * 1024
MAX_REPLY_RING_BYTES: Final = 64 * 1024 * 1024
