"""Fuzz the daemon's wire protocol (every version's messages) from protocol/SPEC.md alone: generated
messages from a seed (valid requests, each field of each message broken in turn, bit flips,
truncations, ext types and msgpack Timestamps in any field, depth bombs, non-string keys,
multi-frame messages, duplicate ids, cancels of running requests, throwaway sessions) plus
a fixed corpus of messages that once hurt the daemon; every reply is checked against the
spec, a `health` sentinel after every message must find the daemon ready, and the worker
pids and restart counters must not change.

Beside the lanes, a canary session streams a greedy request every 250 messages and a
second session every 400 reuses the lanes' recent ids (its own requests: they must run)
and cancels them, and cancels ids in flight in other sessions (which must not end them).

    python -m scripts.fuzz_wire --endpoint ipc:///run/hybridd/hybridd.sock --count 10000 --seed 1
    python -m scripts.fuzz_wire --start --count 10000          # starts its own daemon

Each of `--lanes` DEALER connections sends one message at a time and reads its replies
until the spec says they are complete (a `cancel` is followed by a `health` as a
barrier, since a valid cancel has no reply); a message whose replies the spec cannot
predict (a bit flip) goes on a session of its own, closed after a sentinel. Prints a
JSON report; exits 1 on any violation (`--progress`: each on stderr, with its frames).
"""

from __future__ import annotations

import json
import random
import string
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from hybridd.bench import daemon
from hybridd.bench.daemon import dealer, pack

ERROR_CODES = {"malformed", "too_large", "unsupported_version", "invalid_request", "overloaded", "draining",
               "engine_dead", "timeout", "cancelled", "not_found", "internal"}
# Codes a request can earn by being what it is; the others mean the daemon failed.
VERSIONS = (1, 2, 3, 4)  # the versions SPEC.md §7 says the daemon speaks
REQUEST_CODES = {"malformed", "too_large", "unsupported_version", "invalid_request", "overloaded"}
# Codes a message whose replies cannot be predicted (a bit flip) may earn from a daemon that works.
ANY_CODES = REQUEST_CODES | {"timeout", "cancelled", "unavailable"}
# SPEC §2 forbids ext types without naming the code.
EXT_CODES = {"malformed", "too_large", "invalid_request"}
FINISH_REASONS = {"stop", "length", "cancelled", "timeout", "error"}
STATES = {"starting", "loading", "capturing", "ready", "degraded", "draining", "stopped", "dead"}
CANARY_EVERY = 250  # messages between two canary streams
SECOND_SESSION_EVERY = 400  # messages between two rounds of the second session
MAX_ID = 128
REPLY_TIMEOUT_S = 60.0
VOCAB_GUESS = 1000  # the embedded model's vocabulary is larger; ids below this are in it


# ---------------------------------------------------------------- messages


@dataclass
class Case:
    """One message to send and what the spec says must come back."""

    frames: list[bytes]
    label: str
    # "request": replies with `rid` (chunks allowed for generate) then one terminal;
    # "refused": exactly one error (with `rid`, or "" when `rid` is None), nothing else;
    # "silent": no reply at all (a valid cancel);
    # "any": replies the spec cannot predict (a bit flip): sent on a session of its own,
    #   every reply checked for its shape and for a code a daemon that works can send;
    # "duplicate": a generate `rid` then the same id again at once: the first runs, the
    #   second earns an error with id "";
    # "cancelled": a long generate `rid` then its cancel: a final, cancelled unless it ended first;
    # "routing_id": on a connection that chose its routing id: nothing runs, at most an
    #   invalid_request error comes back (ZeroMQ may refuse the connection instead).
    expect: str
    rid: str | None
    kind: str = ""  # the request's type, for "request"
    codes: set[str] = field(default_factory=lambda: set(REQUEST_CODES))
    version: int = 1  # the version the request's replies must have
    rid_optional: bool = False  # a refusal may name the request or not (an ext type deep inside it)
    routing_id: bytes | None = None  # a connection of its own that sets ZMQ_ROUTING_ID to this


def new_id(rng: random.Random) -> str:
    return "f" + "".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(6, 20)))


def valid_sampling(rng: random.Random) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": rng.randint(1, 3) if rng.random() < 0.97 else
                                rng.choice([16, 64, 300, 65_536])}
    for name, make in (
        ("temperature", lambda: rng.choice([0, 0.0, 0.5, 1, 1.7, 1e-3])),
        ("top_k", lambda: rng.choice([0, -1, 1, 5, 50])),
        ("top_p", lambda: rng.choice([1.0, 0.9, 0.5, 1, 0.999])),
        ("seed", lambda: rng.choice([None, 0, 7, 2**63 - 1])),
        ("repetition_penalty", lambda: rng.choice([1.0, 1.1, 0.9, 2])),
        ("presence_penalty", lambda: rng.choice([0.0, -2, 2, 0.5])),
        ("frequency_penalty", lambda: rng.choice([0.0, -2, 2, 0.5])),
        ("stop", lambda: rng.choice([[], ["\n"], ["a", "zz"]])),
        ("stop_token_ids", lambda: rng.choice([[], [5], [1, 2, 3]])),
        ("ignore_eos", lambda: rng.choice([True, False])),
    ):
        if rng.random() < 0.3:
            sampling[name] = make()
    return sampling


def valid_request(rng: random.Random, version: int = 1) -> tuple[dict[str, Any], str]:
    kind = rng.choices(["generate", "health", "status", "cancel"], weights=[5, 2, 1, 2])[0]
    message: dict[str, Any] = {"v": version, "type": kind, "id": new_id(rng)}
    if kind == "generate":
        roll = rng.random()
        if roll < 0.6 or version == 1 and roll < 0.8:
            message["prompt"] = rng.choice(["ROMEO:", "Hi", "é漢😀", "a" * rng.randint(1, 200)])
        elif roll < 0.8:
            message["messages"] = [{"role": rng.choice(["user", "system", "assistant"]),
                                    "content": rng.choice(["", "Hi", "What light?"])}
                                   | ({"name": "PARIS"} if rng.random() < 0.2 else {})
                                   for _ in range(rng.randint(1, 3))]
        else:
            message["prompt_token_ids"] = [rng.randrange(VOCAB_GUESS) for _ in range(rng.randint(1, 30))]
        message["sampling"] = valid_sampling(rng)
        if version >= 2:
            for name, make in (("n", lambda: rng.choice([1, 2, 3, 16])),
                               ("logprobs", lambda: rng.choice([True, False])),
                               ("top_logprobs", lambda: rng.choice([0, 1, 5]))):
                if rng.random() < 0.3:
                    message["sampling"][name] = make()
            if message["sampling"].get("top_logprobs") and not message["sampling"].get("logprobs"):
                message["sampling"]["logprobs"] = True
        if version >= 4 and rng.random() < 0.2:
            message["sampling"]["prompt_logprobs"] = rng.choice([None, 0, 1, 5])
        if version >= 3 and rng.random() < 0.3:
            message["cache_salt"] = rng.choice(["tenant-a", "b", "é" * 256])
        if rng.random() < 0.3:
            message["stream"] = rng.choice([True, False, None])
        if rng.random() < 0.2:
            message["timeout_s"] = rng.choice([0.001, 0.05, 1, 2.5, 30.5, 3600, 1e-300])
        if message["sampling"]["max_tokens"] > 64:  # a long one ends within the lane's patience
            message["timeout_s"] = min(message.get("timeout_s", 20), 20)
    elif kind == "cancel":
        message["target"] = new_id(rng)
    return message, kind


# Values that break a field of the given kind, each clearly outside SPEC §2-3.
BAD_VALUES: dict[str, list[Any]] = {
    "int": ["1", 1.5, None, True, [], {}, b"\x01", -(2**63), 2**64 - 1, float("nan")],
    "float": ["1", None, True, [], {}, float("nan"), float("inf"), -float("inf"), b"x"],
    "str": [1, None, True, [], {}, b"bytes", ""],
    "bool": [1, 0, "true", None, [], 1.0],
    "list": ["x", 1, None, {}, [None], [[1]]],
}
# (path, kind, out-of-range values) for generate's fields.
GENERATE_FIELDS: list[tuple[tuple[str, ...], str, list[Any]]] = [
    (("prompt",), "str", ["x" * 1_048_577]),
    (("prompt_token_ids",), "list", [[], [-1], [2**31], ["1"], [1.0], [True]]),
    (("stream",), "bool", []),
    (("timeout_s",), "float", [0, -1, 3600.001, 1e300]),
    (("sampling", "max_tokens"), "int", [0, -1, 65_537, 2**40]),
    (("sampling", "temperature"), "float", [-0.1, -1e-300]),
    (("sampling", "top_k"), "int", [-2, -(2**40)]),
    (("sampling", "top_p"), "float", [0, -0.5, 1.000001, 2]),
    (("sampling", "seed"), "int", [-1, 2**63]),
    (("sampling", "repetition_penalty"), "float", [0, -1]),
    (("sampling", "presence_penalty"), "float", [-2.0001, 2.5, 1e9]),
    (("sampling", "frequency_penalty"), "float", [-3, 2.0001]),
    (("sampling", "stop"), "list", [["x"] * 17, [""], ["y" * 257], [1]]),
    (("sampling", "stop_token_ids"), "list", [list(range(65)), [-1], [2**31], ["a"]]),
    (("sampling", "ignore_eos"), "bool", []),
]
# Fields of later versions (§3.1), with the version that has them.
LATER_FIELDS: list[tuple[tuple[str, ...], str, list[Any], int]] = [
    (("messages",), "list", [[], [{"role": "user"}], [{"role": "", "content": "x"}], [{"content": "x"}],
                             [{"role": "user", "content": "x", "bogus": 1}], [{"role": "user", "content": 1}],
                             ["x"], [{"role": "u" * 65, "content": "x"}],
                             [{"role": "user", "content": "x", "name": ""}],
                             [{"role": "user", "content": "x" * 600_000}] * 2,
                             [{"role": "user", "content": "x"}] * 1025],
     2),
    (("sampling", "n"), "int", [0, -1, 17, 2**40], 2),
    (("sampling", "logprobs"), "bool", [], 2),
    (("sampling", "top_logprobs"), "int", [-1, 21, 2**40], 2),
    (("cache_salt",), "str", ["s" * 257], 3),
    (("sampling", "prompt_logprobs"), "int", [-1, 21, 2**40], 4),
]
# attach_ring's fields: (name, out-of-range values); a valid one names no memfd of ours (None: the field left out).
RING_FIELDS: list[tuple[str, list[Any]]] = [
    ("fd", [-1, 2**31, "3", None, 1.0, True]),
    ("bytes", [0, 65_535, 67_108_865, -1, "65536", None]),
]


def set_or_drop(message: dict, key: str, value: Any) -> None:
    """message[key] = value; None leaves the field out."""
    if value is None:
        message.pop(key, None)
    else:
        message[key] = value


def put(message: dict, path: tuple[str, ...], value: Any) -> None:
    """message[path[0]][path[1]]... = value, the maps on the way made where missing."""
    for key in path[:-1]:
        message = message.setdefault(key, {})
    message[path[-1]] = value


def broken_request(rng: random.Random) -> Case:
    """A generate, cancel, health, status or attach_ring with exactly one thing wrong."""
    version = rng.choice(VERSIONS)
    if version >= 2 and rng.random() < 0.1:
        return broken_ring(rng, version)
    if rng.random() < 0.05:
        return chosen_routing_id(rng, version)
    message, kind = valid_request(rng, version)
    rid = message["id"]
    if kind == "generate" and version >= 2 and rng.random() < 0.3:
        path, kind_of, ranges, since = rng.choice(LATER_FIELDS)
        if since > version:  # a later version's field in an earlier version's message is unknown there
            bad = {"messages": [{"role": "user", "content": "x"}], "n": 2, "logprobs": True, "top_logprobs": 1,
                   "cache_salt": "s", "prompt_logprobs": 1}[path[-1]]
        else:
            bad = rng.choice(BAD_VALUES[kind_of] + ranges * 2)
            if bad is None and path[-1] != "messages":
                bad = BAD_VALUES[kind_of][0]
        if path == ("messages",):
            message.pop("prompt", None)
            message.pop("prompt_token_ids", None)
        put(message, path, bad)
        return Case([pack(message)], ".".join(path) + f" v{version}", "refused", rid,
                    codes={"invalid_request", "too_large"}, version=version)
    choice = rng.randrange(9)
    if choice == 0:  # the envelope's id
        set_or_drop(message, "id", rng.choice([None, 1, "", "x" * (MAX_ID + 1), "y" * 300, b"id", [], True]))
        return Case([pack(message)], f"{kind}.id", "refused", None, codes={"invalid_request", "too_large"},
                    version=version)
    if choice == 1:  # the version
        bad = rng.choice([0, max(VERSIONS) + 1, 99, -1, 2**40])
        message["v"] = bad
        return Case([pack(message)], f"{kind}.v={bad}", "refused", rid, codes={"unsupported_version"})
    if choice == 2:
        set_or_drop(message, "v", rng.choice(["1", None, 1.0, True, [], b"\x01"]))
        return Case([pack(message)], f"{kind}.v type", "refused", rid, codes={"invalid_request"},
                    rid_optional=True)
    if choice == 3:  # the type
        message["type"] = rng.choice(["generate2", "", "chunk", "final", "error", "status_reply", "ready", "step",
                                      "shutdown", 5, None, "GENERATE"])
        return Case([pack(message)], "type", "refused", rid, codes={"invalid_request"}, version=version)
    if choice == 4:  # an unknown field, at the top or inside sampling
        if kind == "generate" and rng.random() < 0.5:
            message["sampling"]["bogus"] = 1
        else:
            message[rng.choice(["bogus", "Prompt", "extra", "model"])] = rng.choice([1, "x", None])
        return Case([pack(message)], f"{kind}.unknown field", "refused", rid, codes={"invalid_request"},
                    version=version)
    if kind == "cancel":
        message["target"] = rng.choice([1, None, "", "t" * (MAX_ID + 1), [], b"x"])
        return Case([pack(message)], "cancel.target", "refused", rid, codes={"invalid_request", "too_large"},
                    version=version)
    if kind != "generate":
        message[rng.choice(["prompt", "sampling", "target"])] = 1
        return Case([pack(message)], f"{kind}.extra field", "refused", rid, codes={"invalid_request"},
                    version=version)
    path, kind_of, ranges = rng.choice(GENERATE_FIELDS)
    bad = rng.choice(BAD_VALUES[kind_of] + ranges * 2)
    if bad is None and path[-1] not in ("prompt", "prompt_token_ids"):
        bad = BAD_VALUES[kind_of][0]  # nil means the default there: not an error
    if path in (("prompt_token_ids",), ("prompt",)):  # the prompt's other forms out
        for other in {"prompt", "prompt_token_ids", "messages"} - {path[0]}:
            message.pop(other, None)
    put(message, path, bad)
    return Case([pack(message)], ".".join(path), "refused", rid, codes={"invalid_request", "too_large"},
                version=version)


def chosen_routing_id(rng: random.Random, version: int) -> Case:
    """A valid message from a connection that set ZMQ_ROUTING_ID: not executed (SPEC §1)."""
    message, kind = valid_request(rng, version)
    # Not a zero byte and 4 more: those look like the ids ZeroMQ assigns, and the daemon cannot tell them apart.
    routing_id = rng.choice([b"abc", b"\x00" + rng.randbytes(5), b"\x00\x01",
                             rng.randbytes(rng.randint(1, 255)).replace(b"\x00", b"z")])
    return Case([pack(message)], "chosen routing id", "routing_id", None, kind=kind, version=version,
                routing_id=routing_id)


def broken_ring(rng: random.Random, version: int) -> Case:
    """An attach_ring with one field broken, or a well-formed one whose fd is no memfd of
    this process: an error either way (`unavailable` on a host without rings)."""
    rid = new_id(rng)
    message: dict[str, Any] = {"v": version, "type": "attach_ring", "id": rid, "fd": rng.randint(0, 64),
                               "bytes": rng.choice([65_536, 1 << 20])}
    if rng.random() < 0.3:
        return Case([pack(message)], "attach_ring no memfd", "request", rid, kind="attach_ring",
                    codes={"invalid_request", "unavailable"}, version=version)
    name, values = rng.choice(RING_FIELDS)
    set_or_drop(message, name, rng.choice(values))
    return Case([pack(message)], f"attach_ring.{name}", "refused", rid, codes={"invalid_request"}, version=version)


def garbage(rng: random.Random) -> Case:
    """Frames that are not a message at all; the error cannot name a request."""
    choice = rng.randrange(8)
    if choice == 0:
        frame = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
        try:  # random bytes that happen to be a valid map are not garbage
            if isinstance(msgpack.unpackb(frame), dict):
                frame = b"\xc1" + frame
        except Exception:
            pass
        return Case([frame], "random bytes", "refused", None, codes={"malformed", "too_large"})
    if choice == 1:
        return Case([pack(rng.choice([[], [1, 2], 5, "text", None, True, 1.5, b"bin"]))], "not a map",
                    "refused", None, codes={"malformed"})
    if choice == 2:
        full = pack({"v": 1, "type": "health", "id": new_id(rng)})
        return Case([full[: rng.randint(1, len(full) - 1)]], "truncated", "refused", None, codes={"malformed"})
    if choice == 3:
        full = pack({"v": 1, "type": "health", "id": new_id(rng)})
        return Case([full + b"\x01"], "trailing bytes", "refused", None, codes={"malformed"})
    if choice == 4:  # ext types, a timestamp among them
        value = msgpack.Timestamp(rng.randint(0, 2**32 - 1)) if rng.random() < 0.3 else msgpack.ExtType(
            rng.randint(0, 127), b"\x00" * rng.randint(0, 8))
        return Case([pack({"v": 1, "type": "health", "id": value})], "ext type", "refused", None,
                    codes=EXT_CODES)
    if choice == 5:  # deep nesting
        depth = rng.choice([600, 5000])
        return Case([b"\x91" * depth + b"\x00"], f"nesting {depth}", "refused", None, codes={"malformed", "too_large"})
    if choice == 6:  # non-string keys, a map of the wrong size
        return Case([pack({1: 1, "v": 1})], "int key", "refused", None, codes={"malformed", "invalid_request"})
    rid = new_id(rng)
    frames = [pack({"v": 1, "type": "health", "id": rid}), pack({"v": 1})]
    if rng.random() < 0.5:
        frames = [b"", frames[0]]  # a REQ-style empty delimiter
    return Case(frames, "multi-frame", "refused", None, codes={"malformed"})


def mutated(rng: random.Random) -> Case:
    """A message of any version with something done to its bytes or deep inside it."""
    version = rng.choice(VERSIONS)
    message, kind = valid_request(rng, version)
    rid = message["id"]
    choice = rng.randrange(6)
    if choice == 0:  # bit flips: anything may come back, on a session of its own
        frame = bytearray(pack(message))
        for _ in range(rng.randint(1, 3)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        return Case([bytes(frame)], "bit flip", "any", None)
    if choice == 1:  # a truncated message of any kind is never a whole msgpack value
        full = pack(message)
        return Case([full[: rng.randint(1, len(full) - 1)]], "truncated message", "refused", None,
                    codes={"malformed"})
    # The rest go inside a field: the path to one (a new field where the message has none to spare).
    paths = [(name,) for name in message if name not in ("v", "type", "id")] + [("id",), ("v",), ("type",)]
    if isinstance(message.get("sampling"), dict):
        paths += [("sampling", name) for name in message["sampling"]]
    path = rng.choice(paths)
    target = message
    for key in path[:-1]:
        target = target[key]
    named = path != ("id",) and path != ("v",)  # can the refusal name the request?
    if choice == 2:  # an ext type or a Timestamp in any field
        target[path[-1]] = rng.choice([msgpack.Timestamp(rng.randint(0, 2**34 - 1), rng.randint(0, 999_999_999)),
                                       msgpack.Timestamp(-(2**40)), msgpack.ExtType(rng.randint(0, 127), b"\x01")])
        return Case([pack(message)], f"ext in {'.'.join(path)}", "refused", rid if named else None, codes=EXT_CODES,
                    rid_optional=True, version=version)
    if choice == 3:  # a depth bomb in any field
        depth = rng.choice([100, 1000, 20_000])
        frame = pack(message | {path[0]: 0} if len(path) == 1 else message)
        bomb = b"\x91" * depth + b"\x00"
        encoded_key = pack(path[0])
        at = frame.index(encoded_key) + len(encoded_key)
        rest = msgpack.Unpacker()
        rest.feed(frame[at:])
        value_len = len(pack(next(rest)))
        frame = frame[:at] + bomb + frame[at + value_len:]
        return Case([frame], f"nesting {depth} in {path[0]}", "refused", rid if path[0] != "id" else None,
                    codes={"malformed", "too_large", "invalid_request", "unsupported_version"}, rid_optional=True,
                    version=version)
    if choice == 4:  # a non-string key inside a map of the message
        inner = message.get("sampling") if isinstance(message.get("sampling"), dict) and rng.random() < 0.5 else message
        inner[rng.choice([1, -1, 1.5, b"k", True, None])] = 1
        return Case([pack(message)], "non-string key", "refused", rid, codes={"malformed", "invalid_request"},
                    rid_optional=True, version=version)
    # A message of another kind's fields under this kind's type.
    other, _ = valid_request(rng, version)
    message.update({k: v for k, v in other.items() if k not in ("v", "type", "id")})
    return Case([pack(message)], f"{kind} with foreign fields", "any", None)


def running_pair(rng: random.Random) -> Case:
    """A duplicate id in flight, or a cancel of a request that runs."""
    version = rng.choice(VERSIONS)
    rid = new_id(rng)
    generate = {"v": version, "type": "generate", "id": rid, "prompt": "ROMEO:",
                "sampling": {"max_tokens": rng.choice([8, 40]), "temperature": 0}, "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        return Case([pack(generate), pack(generate)], "duplicate id", "duplicate", rid, kind="generate",
                    version=version)
    cancel = {"v": version, "type": "cancel", "id": new_id(rng), "target": rid}
    return Case([pack(generate), pack(cancel)], "cancel running", "cancelled", rid, kind="generate", version=version)


def corpus() -> list[Case]:
    """Messages that once crashed, stalled or confused the daemon (all spec-valid or
    clearly invalid); each must be answered as the spec says and hurt nothing."""
    cases = []

    def generate(label: str, **fields: Any) -> None:
        rid = "corpus-" + label.replace(" ", "-")[:100]
        message = {"v": 1, "type": "generate", "id": rid, "prompt": "ROMEO:",
                   "sampling": {"max_tokens": 4}} | fields
        cases.append(Case([pack(message)], label, "request", rid, kind="generate"))

    for top_p in (1e-300, 5e-324, 1e-45, 1e-38, 0.9999999999):
        generate(f"top_p {top_p}", sampling={"max_tokens": 4, "top_p": top_p, "temperature": 1.0})
    generate("temperature 1e-40 top_p 0.9", sampling={"max_tokens": 4, "temperature": 1e-40, "top_p": 0.9})
    generate("temperature 5e-324", sampling={"max_tokens": 4, "temperature": 5e-324})
    generate("temperature 1e300", sampling={"max_tokens": 4, "temperature": 1e300})
    generate("repetition_penalty 5e-324", sampling={"max_tokens": 4, "repetition_penalty": 5e-324, "top_p": 0.9})
    generate("repetition_penalty 1e300", sampling={"max_tokens": 4, "repetition_penalty": 1e300})
    generate("top_k 2^31", sampling={"max_tokens": 4, "top_k": 2**31 - 1, "top_p": 0.5})
    generate("seed max", sampling={"max_tokens": 4, "seed": 2**63 - 1, "temperature": 1.0})
    generate("stop token outside vocab", sampling={"max_tokens": 4, "stop_token_ids": [2**31 - 1]})
    generate("token id outside vocab", prompt=None, prompt_token_ids=[2**31 - 1])
    generate("prompt too long for the model", prompt="ROMEO " * 5000)
    generate("emoji prompt", prompt="😀" * 20_000)
    generate("timeout tiny", timeout_s=1e-9)
    for length in (MAX_ID + 1, 300):
        message = {"v": 1, "type": "health", "id": "i" * length}
        cases.append(Case([pack(message)], f"id of {length} characters", "refused", None,
                          codes={"invalid_request", "too_large"}))
    cases.append(Case([pack({"v": 1, "type": "health", "id": msgpack.Timestamp(0)})], "timestamp ext",
                      "refused", None, codes=EXT_CODES))
    cases.append(Case([b"\x91" * 100_000 + b"\x00"], "nesting 100000", "refused", None,
                      codes={"malformed", "too_large"}))
    cases.append(Case([pack({"v": 1, "type": "generate", "id": "corpus-str-over-unpacker", "prompt": "x" * 2_000_000})],
                      "prompt of 2,000,000 characters", "refused", "corpus-str-over-unpacker",
                      codes={"invalid_request", "too_large"}))
    return cases


def generated(rng: random.Random) -> Case:
    roll = rng.random()
    if roll < 0.3:
        version = rng.choice(VERSIONS)
        message, kind = valid_request(rng, version)
        expect = "silent" if kind == "cancel" else "request"
        return Case([pack(message)], f"valid {kind}", expect, message["id"], kind=kind, version=version)
    if roll < 0.65:
        return broken_request(rng)
    if roll < 0.8:
        return garbage(rng)
    if roll < 0.95:
        return mutated(rng)
    return running_pair(rng)


# ---------------------------------------------------------------- checking replies


def check_reply(reply: Any) -> str | None:
    """A reply's shape against SPEC §3.2; None when it conforms, else what is wrong."""
    if not isinstance(reply, dict):
        return f"reply is not a map: {type(reply).__name__}"
    kind = reply.get("type")
    base = {"v", "type", "id"}
    version = reply.get("v")
    shapes = {
        "chunk": base | {"index", "text", "token_ids"} | ({"logprobs"} if version != 1 else set()),
        "final": base | ({"text", "token_ids", "finish_reason"} if version == 1 else {"choices"}) | {"usage", "timings"}
        | ({"prompt_logprobs"} if version >= 4 else set()),
        "error": base | {"code", "message", "field"},
        "status_reply": base | {"status"},
        "health_reply": base | {"state", "ok"},
        "ring_attached": base,
    }
    if kind not in shapes:
        return f"unknown reply type {kind!r}"
    if set(reply) != shapes[kind]:
        return f"{kind} has fields {sorted(reply)}"
    # Replies use the request's version; an error for a message whose version cannot be
    # used, the newest (SPEC §7).
    if reply["v"] not in VERSIONS or not isinstance(reply["id"], str) or len(reply["id"]) > MAX_ID:
        return f"bad envelope {reply['v']!r} {reply['id']!r}"
    ints = lambda xs: isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in xs)  # noqa: E731
    if kind == "chunk":
        if not (isinstance(reply["index"], int) and reply["index"] >= 0 and isinstance(reply["text"], str)
                and ints(reply["token_ids"])):
            return "bad chunk"
    elif kind == "final":
        usage, timings = reply["usage"], reply["timings"]
        choices = [reply] if version == 1 else reply["choices"]
        if not isinstance(choices, list) or not choices:
            return "bad final choices"
        for index, choice in enumerate(choices):
            if not (isinstance(choice, dict) and isinstance(choice.get("text"), str) and ints(choice.get("token_ids"))
                    and choice.get("finish_reason") in FINISH_REASONS
                    and (version == 1 or choice.get("index") == index)):
                return "bad final"
        usage_keys = {"prompt_tokens", "completion_tokens"} | ({"cached_tokens"} if version >= 3 else set())
        if not (isinstance(usage, dict) and set(usage) == usage_keys
                and usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)):
            return f"bad usage {usage}"
        if not (isinstance(timings, dict) and set(timings) == {"ttft_s", "total_s", "queue_s"}):
            return f"bad timings {timings}"
    elif kind == "error":
        if reply["code"] not in ERROR_CODES:
            return f"unknown code {reply['code']!r}"
        if not isinstance(reply["message"], str) or not reply["message"] or len(reply["message"]) > 4096:
            return "bad error message"
        if reply["field"] is not None and not (isinstance(reply["field"], str)
                                               and reply["message"].startswith(reply["field"])):
            return f"error message does not start with its field {reply['field']!r}: {reply['message'][:80]!r}"
    elif kind == "health_reply":
        if reply["state"] not in STATES or not isinstance(reply["ok"], bool):
            return "bad health_reply"
    elif kind == "status_reply" and not isinstance(reply["status"], dict):
        return "bad status_reply"
    return None


@dataclass
class Report:
    sent: int = 0
    replies: int = 0
    violations: list[str] = field(default_factory=list)
    by_label: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    sentinels: int = 0
    canaries: int = 0
    second_session_rounds: int = 0
    worker_changes: list[str] = field(default_factory=list)
    progress: bool = False  # each violation on stderr as it is found

    def violation(self, case: Case, text: str) -> None:
        self.violations.append(f"{case.label}: {text}")
        if self.progress:
            print(json.dumps({"violation": self.violations[-1], "frames": [f[:300].hex() for f in case.frames],
                              "at": round(time.time(), 3)}), file=sys.stderr, flush=True)


class Lane:
    """One DEALER connection, one message at a time, a `health` sentinel after each."""

    def __init__(self, context: zmq.Context, endpoint: str, report: Report, lock: threading.Lock,
                 name: str = "lane", recent: list[str] | None = None) -> None:
        self.context = context
        self.endpoint = endpoint
        self.socket = dealer(context, endpoint)
        self.report = report
        self.lock = lock
        self.name = name
        self.recent = recent if recent is not None else []  # ids this lane's generates used, for the second session
        self.barriers = 0
        self.stale = False

    def recv(self, case: Case, deadline: float, socket: zmq.Socket | None = None) -> dict | None:
        socket = socket or self.socket
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not socket.poll(int(remaining * 1000)):
            return None
        frame = socket.recv()
        try:
            reply = msgpack.unpackb(frame, raw=False)
        except Exception as error:
            self._violate(case, f"undecodable reply ({error})")
            return {}
        problem = check_reply(reply)
        if problem:
            self._violate(case, problem)
        with self.lock:
            self.report.replies += 1
        return reply

    def _violate(self, case: Case, text: str) -> None:
        with self.lock:
            self.report.violation(case, text)
        self.stale = True

    def _send(self, case: Case, socket: zmq.Socket | None = None) -> None:
        socket = socket or self.socket
        if case.expect in ("duplicate", "cancelled"):  # two messages, one after the other
            for frame in case.frames:
                socket.send(frame)
        else:
            socket.send_multipart(case.frames)
        with self.lock:
            self.report.sent += 1
            self.report.by_label[case.label] += 1
        if case.kind == "generate" and case.rid:
            self.recent.append(case.rid)
            del self.recent[:-32]

    def sentinel(self, case: Case, socket: zmq.Socket | None = None) -> None:
        """A health after the message: it must come back, and the daemon must be ready."""
        self.barriers += 1
        barrier = f"sentinel-{self.name}-{self.barriers}"
        socket = socket or self.socket
        socket.send(pack({"v": 1, "type": "health", "id": barrier}))
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            reply = self.recv(case, deadline, socket)
            if reply is None:
                self._violate(case, "no reply to the sentinel health")
                return
            if reply.get("id") == barrier:
                break
            if socket is self.socket:
                self._violate(case, f"a reply after the request's last: {str(reply)[:200]}")
                return
        with self.lock:
            self.report.sentinels += 1
        if not (reply.get("ok") and reply.get("state") == "ready"):
            self._violate(case, f"the daemon is not ready after this message: {reply}")

    def run(self, case: Case) -> None:
        if case.expect == "any":
            self._run_alone(case)
            return
        if case.expect == "routing_id":
            self._run_chosen_routing_id(case)
            self.sentinel(case)
            return
        self._send(case)
        self._await(case)
        self.sentinel(case)
        if self.stale:  # replies left unread after a violation would be taken for the next case's
            self.socket.close()
            self.socket = dealer(self.context, self.endpoint)
            self.stale = False

    def _run_alone(self, case: Case) -> None:
        """On a session of its own: send, then a sentinel; every reply before the sentinel's
        is checked for its shape and code; the session ends (its requests are cancelled)."""
        socket = dealer(self.context, self.endpoint)
        try:
            self._send(case, socket)
            self.sentinel(case, socket)
        finally:
            socket.close()

    def _run_chosen_routing_id(self, case: Case) -> None:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTING_ID, case.routing_id)
        socket.connect(self.endpoint)
        try:
            self._send(case, socket)
            deadline = time.monotonic() + 2.0  # a refused connection hears nothing
            while (reply := self.recv(case, deadline, socket)) is not None:
                if reply and not (reply["type"] == "error" and reply["code"] == "invalid_request"
                                  and reply["message"].startswith("ZMQ_ROUTING_ID")):
                    self._violate(case, f"a connection with its own routing id got {str(reply)[:200]}")
                    return
                if reply:
                    return
        finally:
            socket.close()

    def _await(self, case: Case) -> None:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        if case.expect == "silent":
            return
        want_id = case.rid if case.rid is not None else ""
        # What must still come: the request's terminal reply, and for a duplicate the "" error.
        pending = {want_id} | ({""} if case.expect == "duplicate" else set())
        if case.rid_optional:
            pending = {"*"}
        index = 0
        while pending:
            reply = self.recv(case, deadline)
            if reply is None:
                self._violate(case, f"no terminal reply (hung), waiting for {sorted(pending)}")
                return
            if not reply:
                continue
            rid = reply.get("id")
            if "*" in pending and rid in (want_id, ""):
                pending = {rid}
            if rid not in pending:
                self._violate(case, f"reply for id {str(rid)[:40]!r}, expected {sorted(pending)}: "
                                    f"{reply.get('type')} {reply.get('code')} {str(reply.get('message'))[:100]}")
                return
            kind = reply["type"]
            if case.expect != "refused" and reply["v"] != case.version:
                self._violate(case, f"a version {case.version} request answered in version {reply['v']}")
            if case.expect == "duplicate" and rid == "":
                if kind != "error" or reply["code"] != "invalid_request" or reply["field"] != "id":
                    self._violate(case, f"the duplicate id earned {kind} {reply.get('code')}")
                pending.discard("")
                continue
            if kind == "chunk":
                if case.expect == "refused" or case.kind != "generate":
                    self._violate(case, "a chunk for a request that cannot stream")
                    return
                if case.version == 1 and reply["index"] != index:
                    self._violate(case, f"chunk index {reply['index']}, expected {index}")
                index += 1
                continue
            pending.discard(rid)
            if kind == "error":
                with self.lock:
                    self.report.codes[reply["code"]] += 1
                if reply["code"] not in case.codes:
                    self._violate(case, f"code {reply['code']} not in {sorted(case.codes)}: {reply['message'][:120]}")
            elif case.expect == "refused":
                self._violate(case, f"a {kind} for a message the spec refuses")
            elif case.kind == "generate" and kind != "final" or case.kind == "health" and kind != "health_reply" \
                    or case.kind == "status" and kind != "status_reply" \
                    or case.kind == "attach_ring" and kind != "ring_attached":
                self._violate(case, f"{kind} answers a {case.kind}")
            elif case.expect == "cancelled":
                reasons = {c["finish_reason"] for c in ([reply] if reply["v"] == 1 else reply["choices"])}
                if not reasons <= {"cancelled", "length", "stop"}:
                    self._violate(case, f"a cancelled request ended {reasons}")

    def close(self) -> None:
        self.socket.close()


class SideSession:
    """A session of its own beside the lanes, that records its violations in the report."""

    def __init__(self, context: zmq.Context, endpoint: str, report: Report, lock: threading.Lock) -> None:
        self.socket = dealer(context, endpoint)
        self.report, self.lock = report, lock
        self.rounds = 0

    def next_reply(self, deadline: float) -> dict | None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self.socket.poll(int(remaining * 1000)):
            return None
        return msgpack.unpackb(self.socket.recv())

    def _violate(self, text: str) -> None:
        with self.lock:
            self.report.violations.append(text)

    def close(self) -> None:
        self.socket.close()


class Canary(SideSession):
    """Streams a greedy request every CANARY_EVERY messages: each must stream its tokens
    and end, whatever the lanes send beside it."""

    def round(self) -> None:
        self.rounds += 1
        rid = f"canary-{self.rounds}"
        self.socket.send(pack({"v": 3, "type": "generate", "id": rid, "prompt": "ROMEO:",
                               "sampling": {"max_tokens": 24, "temperature": 0, "ignore_eos": True}}))
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        chunks = 0
        while True:
            reply = self.next_reply(deadline)
            if reply is None:
                self._violate(f"canary {rid}: no final")
                return
            if reply.get("id") != rid or check_reply(reply):
                self._violate(f"canary {rid}: unexpected reply {str(reply)[:200]}")
                return
            if reply["type"] == "chunk":
                chunks += 1
                continue
            if reply["type"] != "final" or reply["choices"][0]["finish_reason"] != "length" or chunks != 24:
                self._violate(f"canary {rid}: ended with {str(reply)[:200]} after {chunks} chunks")
            with self.lock:
                self.report.canaries += 1
            return


class SecondSession(SideSession):
    """Every SECOND_SESSION_EVERY messages: a generate under an id the lanes used lately
    (its own request: it runs), its cancel, and cancels of ids in flight in the lanes'
    sessions (another session's: nothing happens to them)."""

    def __init__(self, context: zmq.Context, endpoint: str, report: Report, lock: threading.Lock,
                 recent: list[str]) -> None:
        super().__init__(context, endpoint, report, lock)
        self.recent = recent

    def round(self) -> None:
        self.rounds += 1
        with self.lock:
            ids = list(self.recent[-8:])
        if not ids:
            return
        reused = ids[-1]
        self.socket.send(pack({"v": 1, "type": "generate", "id": reused, "prompt": "ROMEO:",
                               "sampling": {"max_tokens": 30, "temperature": 0}, "stream": False}))
        for target in ids:
            self.socket.send(pack({"v": 1, "type": "cancel", "id": f"second-{self.rounds}", "target": target}))
        barrier = f"second-barrier-{self.rounds}"
        self.socket.send(pack({"v": 1, "type": "health", "id": barrier}))
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        seen = set()
        while seen != {reused, barrier}:
            reply = self.next_reply(deadline)
            if reply is None:
                self._violate(f"second session round {self.rounds}: waiting for {sorted({reused, barrier} - seen)}")
                return
            if check_reply(reply) or reply.get("id") not in (reused, barrier) or reply["type"] == "error":
                self._violate(f"second session round {self.rounds}: unexpected reply {str(reply)[:200]}")
                return
            if reply["type"] == "final" and reply["finish_reason"] not in ("cancelled", "length", "stop"):
                self._violate(f"second session round {self.rounds}: its request ended {reply['finish_reason']}")
            seen.add(reply["id"])
        with self.lock:
            self.report.second_session_rounds += 1


def workers_of(context: zmq.Context, endpoint: str) -> dict:
    return daemon.status_of(context, endpoint)["workers"]


def fuzz(endpoint: str, count: int, seed: int, lanes: int = 8, with_corpus: bool = True,
         progress: bool = False) -> Report:
    """Send `count` generated messages (plus the corpus) over `lanes` connections, with the
    canary and the second session beside them."""
    rng = random.Random(seed)
    cases = (corpus() if with_corpus else []) + [generated(rng) for _ in range(count)]
    context = zmq.Context()
    report = Report(progress=progress)
    lock = threading.Lock()
    before = workers_of(context, endpoint)
    queue = list(reversed(cases))
    recent: list[str] = []
    started = time.monotonic()
    canary = Canary(context, endpoint, report, lock)
    second = SecondSession(context, endpoint, report, lock, recent)
    due = threading.Condition(lock)
    done = threading.Event()

    def work(index: int) -> None:
        lane = Lane(context, endpoint, report, lock, f"lane{index}", recent)
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    case = queue.pop()
                lane.run(case)
                with lock:
                    due.notify_all()
        finally:
            lane.close()

    def beside() -> None:
        """The canary, the second session and the workers' check, as the count passes their marks."""
        marks = {"canary": CANARY_EVERY, "second": SECOND_SESSION_EVERY, "workers": 500}
        while not done.is_set():
            with lock:
                due.wait(1.0)
                sent = report.sent
            if sent >= marks["canary"]:
                marks["canary"] += CANARY_EVERY
                canary.round()
            if sent >= marks["second"]:
                marks["second"] += SECOND_SESSION_EVERY
                second.round()
            if sent >= marks["workers"]:
                marks["workers"] += 500
                now = workers_of(context, endpoint)
                if now != before:
                    with lock:
                        report.worker_changes.append(f"after {sent} messages ({time.monotonic() - started:.0f} s): "
                                                     f"{now}")
                if progress:
                    print(json.dumps({"sent": sent, "seconds": round(time.monotonic() - started),
                                      "violations": len(report.violations), "workers": now}),
                          file=sys.stderr, flush=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(lanes)]
    watcher = threading.Thread(target=beside)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    report.seconds = time.monotonic() - started
    after = workers_of(context, endpoint)
    if after != before:
        report.violations.append(f"workers changed: {before} -> {after}")
    report.violations += [f"workers changed {change}" for change in report.worker_changes]
    canary.close()
    second.close()
    context.destroy(linger=0)
    return report


def main() -> int:
    parser = daemon.argument_parser(__doc__)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--progress", action="store_true", help="a line on stderr every 500 messages")
    args = parser.parse_args()
    with daemon.daemon_endpoint(args) as endpoint:
        report = fuzz(endpoint, args.count, args.seed, args.lanes, progress=args.progress)
    summary = {
        "messages": report.sent, "replies": report.replies, "seconds": round(report.seconds, 1),
        "sentinels": report.sentinels, "canaries": report.canaries,
        "second_session_rounds": report.second_session_rounds, "worker_changes": report.worker_changes,
        "violations": len(report.violations), "first_violations": report.violations[:20],
        "violations_by_kind": dict(Counter(v.split(":")[0] + ": " + v.split(":")[1].split(" for id ")[0][:60]
                                           for v in report.violations).most_common()),
        "error_codes": dict(report.codes), "kinds": len(report.by_label), "corpus_messages": len(corpus()),
    }
    print(json.dumps(summary, indent=2))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
