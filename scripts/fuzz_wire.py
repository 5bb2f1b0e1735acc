"""Fuzz the daemon's wire protocol (version 1 messages) from protocol/SPEC.md alone: generated messages from a
seed (valid requests, each field broken in turn, bytes that are not msgpack, maps that
are not messages) plus a fixed corpus of messages that once hurt the daemon; every reply
is checked against the spec, and the worker pids and restart counters must not change.

    python -m scripts.fuzz_wire --endpoint ipc:///run/hybridd/hybridd.sock --count 10000 --seed 1
    python -m scripts.fuzz_wire --start --count 10000          # starts its own daemon

Each of `--lanes` DEALER connections sends one message at a time and reads its replies
until the spec says they are complete (a `cancel` is followed by a `health` as a
barrier, since a valid cancel has no reply). Prints a JSON report; exits 1 on any
violation.
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

from scripts import daemon

ERROR_CODES = {"malformed", "too_large", "unsupported_version", "invalid_request", "overloaded", "draining",
               "engine_dead", "timeout", "cancelled", "not_found", "internal"}
# Codes a request can earn by being what it is; the others mean the daemon failed.
VERSIONS = (1, 2, 3, 4)  # the versions SPEC.md §7 says the daemon speaks
REQUEST_CODES = {"malformed", "too_large", "unsupported_version", "invalid_request", "overloaded"}
# SPEC §2 forbids ext types without naming the code.
EXT_CODES = {"malformed", "too_large", "invalid_request"}
FINISH_REASONS = {"stop", "length", "cancelled", "timeout", "error"}
STATES = {"starting", "loading", "capturing", "ready", "degraded", "draining", "stopped", "dead"}
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
    # "silent": no reply at all (a valid cancel).
    expect: str
    rid: str | None
    kind: str = ""  # the request's type, for "request"
    codes: set[str] = field(default_factory=lambda: set(REQUEST_CODES))


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def new_id(rng: random.Random) -> str:
    return "f" + "".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(6, 20)))


def valid_sampling(rng: random.Random) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": rng.randint(1, 3)}
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


def valid_request(rng: random.Random) -> tuple[dict[str, Any], str]:
    kind = rng.choices(["generate", "health", "status", "cancel"], weights=[5, 2, 1, 2])[0]
    message: dict[str, Any] = {"v": 1, "type": kind, "id": new_id(rng)}
    if kind == "generate":
        if rng.random() < 0.8:
            message["prompt"] = rng.choice(["ROMEO:", "Hi", "é漢😀", "a" * rng.randint(1, 200)])
        else:
            message["prompt_token_ids"] = [rng.randrange(VOCAB_GUESS) for _ in range(rng.randint(1, 30))]
        message["sampling"] = valid_sampling(rng)
        if rng.random() < 0.3:
            message["stream"] = rng.choice([True, False, None])
        if rng.random() < 0.2:
            message["timeout_s"] = rng.choice([0.001, 1, 30.5, 3600])
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


def broken_request(rng: random.Random) -> Case:
    """A generate, cancel, health or status with exactly one thing wrong."""
    message, kind = valid_request(rng)
    rid = message["id"]
    choice = rng.randrange(9)
    if choice == 0:  # the envelope's id
        bad = rng.choice([None, 1, "", "x" * (MAX_ID + 1), "y" * 300, b"id", [], True])
        if bad is None:
            message.pop("id")
        else:
            message["id"] = bad
        return Case([pack(message)], f"{kind}.id", "refused", None, codes={"invalid_request", "too_large"})
    if choice == 1:  # the version
        bad = rng.choice([0, max(VERSIONS) + 1, 99, -1, 2**40])
        message["v"] = bad
        return Case([pack(message)], f"{kind}.v={bad}", "refused", rid, codes={"unsupported_version"})
    if choice == 2:
        bad = rng.choice(["1", None, 1.0, True, [], b"\x01"])
        if bad is None:
            message.pop("v")
        else:
            message["v"] = bad
        return Case([pack(message)], f"{kind}.v type", "refused", rid, codes={"invalid_request"})
    if choice == 3:  # the type
        message["type"] = rng.choice(["generate2", "", "chunk", "final", "error", "status_reply", "ready", "step",
                                      "shutdown", 5, None, "GENERATE"])
        return Case([pack(message)], "type", "refused", rid, codes={"invalid_request"})
    if choice == 4:  # an unknown field, at the top or inside sampling
        if kind == "generate" and rng.random() < 0.5:
            message["sampling"]["bogus"] = 1
        else:
            message[rng.choice(["bogus", "Prompt", "extra", "model"])] = rng.choice([1, "x", None])
        return Case([pack(message)], f"{kind}.unknown field", "refused", rid, codes={"invalid_request"})
    if kind == "cancel":
        message["target"] = rng.choice([1, None, "", "t" * (MAX_ID + 1), [], b"x"])
        return Case([pack(message)], "cancel.target", "refused", rid, codes={"invalid_request", "too_large"})
    if kind != "generate":
        message[rng.choice(["prompt", "sampling", "target"])] = 1
        return Case([pack(message)], f"{kind}.extra field", "refused", rid, codes={"invalid_request"})
    path, kind_of, ranges = rng.choice(GENERATE_FIELDS)
    bad = rng.choice(BAD_VALUES[kind_of] + ranges * 2)
    if bad is None and path[-1] not in ("prompt", "prompt_token_ids"):
        bad = BAD_VALUES[kind_of][0]  # nil means the default there: not an error
    target = message
    for key in path[:-1]:
        target = target.setdefault(key, {})
    if path == ("prompt_token_ids",):
        message.pop("prompt", None)
    if path == ("prompt",):
        message.pop("prompt_token_ids", None)
    target[path[-1]] = bad
    codes = {"invalid_request", "too_large"}
    return Case([pack(message)], ".".join(path), "refused", rid, codes=codes)


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
    if roll < 0.35:
        message, kind = valid_request(rng)
        expect = "silent" if kind == "cancel" else "request"
        return Case([pack(message)], f"valid {kind}", expect, message["id"], kind=kind)
    if roll < 0.8:
        return broken_request(rng)
    return garbage(rng)


# ---------------------------------------------------------------- checking replies


def check_reply(reply: Any) -> str | None:
    """A reply's shape against SPEC §3.2; None when it conforms, else what is wrong."""
    if not isinstance(reply, dict):
        return f"reply is not a map: {type(reply).__name__}"
    kind = reply.get("type")
    base = {"v", "type", "id"}
    shapes = {
        "chunk": base | {"index", "text", "token_ids"},
        "final": base | {"text", "token_ids", "finish_reason", "usage", "timings"},
        "error": base | {"code", "message", "field"},
        "status_reply": base | {"status"},
        "health_reply": base | {"state", "ok"},
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
        if not (isinstance(reply["text"], str) and ints(reply["token_ids"])
                and reply["finish_reason"] in FINISH_REASONS):
            return "bad final"
        if not (isinstance(usage, dict) and set(usage) == {"prompt_tokens", "completion_tokens"}
                and usage["completion_tokens"] == len(reply["token_ids"])):
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

    def violation(self, case: Case, text: str) -> None:
        self.violations.append(f"{case.label}: {text}")


class Lane:
    """One DEALER connection, one message at a time."""

    def __init__(self, context: zmq.Context, endpoint: str, report: Report, lock: threading.Lock) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.report = report
        self.lock = lock
        self.barriers = 0

    def recv(self, case: Case, deadline: float) -> dict | None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self.socket.poll(int(remaining * 1000)):
            return None
        frame = self.socket.recv()
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

    def run(self, case: Case) -> None:
        self.socket.send_multipart(case.frames)
        with self.lock:
            self.report.sent += 1
            self.report.by_label[case.label] += 1
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        if case.expect == "silent":
            self.barriers += 1
            barrier = f"barrier-{id(self)}-{self.barriers}"
            self.socket.send(pack({"v": 1, "type": "health", "id": barrier}))
            reply = self.recv(case, deadline)
            if reply is None:
                self._violate(case, "no reply to the barrier health")
            elif reply.get("id") != barrier:
                self._violate(case, f"a valid cancel got a reply: {reply}")
            return
        want_id = case.rid if case.rid is not None else ""
        index = 0
        while True:
            reply = self.recv(case, deadline)
            if reply is None:
                self._violate(case, "no terminal reply (hung)")
                return
            if not reply:
                continue
            if reply.get("id") != want_id:
                self._violate(case, f"reply for id {str(reply.get('id'))[:40]!r}, expected {want_id[:40]!r}: "
                                    f"{reply.get('type')} {reply.get('code')} {str(reply.get('message'))[:100]}")
                return
            kind = reply["type"]
            if case.expect == "request" and reply["v"] != 1:
                self._violate(case, f"a version 1 request answered in version {reply['v']}")
            if kind == "chunk":
                if case.expect != "request" or case.kind != "generate":
                    self._violate(case, "a chunk for a request that cannot stream")
                    return
                if reply["index"] != index:
                    self._violate(case, f"chunk index {reply['index']}, expected {index}")
                index += 1
                continue
            if kind == "error":
                with self.lock:
                    self.report.codes[reply["code"]] += 1
                if reply["code"] not in case.codes:
                    self._violate(case, f"code {reply['code']} not in {sorted(case.codes)}: {reply['message'][:120]}")
            elif case.expect == "refused":
                self._violate(case, f"a {kind} for a message the spec refuses")
            elif case.kind == "generate" and kind != "final" or case.kind == "health" and kind != "health_reply" \
                    or case.kind == "status" and kind != "status_reply":
                self._violate(case, f"{kind} answers a {case.kind}")
            return

    def close(self) -> None:
        self.socket.close()


def workers_of(context: zmq.Context, endpoint: str) -> dict:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        socket.send(pack({"v": 1, "type": "status", "id": "fuzz-status"}))
        if not socket.poll(30_000):
            raise TimeoutError("no status reply")
        return msgpack.unpackb(socket.recv())["status"]["workers"]
    finally:
        socket.close()


def fuzz(endpoint: str, count: int, seed: int, lanes: int = 8, with_corpus: bool = True) -> Report:
    """Send `count` generated messages (plus the corpus) over `lanes` connections."""
    rng = random.Random(seed)
    cases = (corpus() if with_corpus else []) + [generated(rng) for _ in range(count)]
    context = zmq.Context()
    report = Report()
    lock = threading.Lock()
    before = workers_of(context, endpoint)
    queue = list(reversed(cases))
    started = time.monotonic()

    def work() -> None:
        lane = Lane(context, endpoint, report, lock)
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    case = queue.pop()
                lane.run(case)
        finally:
            lane.close()

    threads = [threading.Thread(target=work) for _ in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report.seconds = time.monotonic() - started
    after = workers_of(context, endpoint)
    if after != before:
        report.violations.append(f"workers changed: {before} -> {after}")
    context.destroy(linger=0)
    return report


def main() -> int:
    parser = daemon.argument_parser(__doc__)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lanes", type=int, default=8)
    args = parser.parse_args()
    with daemon.daemon_endpoint(args) as endpoint:
        report = fuzz(endpoint, args.count, args.seed, args.lanes)
    summary = {
        "messages": report.sent, "replies": report.replies, "seconds": round(report.seconds, 1),
        "violations": len(report.violations), "first_violations": report.violations[:20],
        "violations_by_kind": dict(Counter(v.split(":")[0] + ": " + v.split(":")[1].split(" for id ")[0][:60]
                                           for v in report.violations).most_common()),
        "error_codes": dict(report.codes), "kinds": len(report.by_label), "corpus_messages": len(corpus()),
    }
    print(json.dumps(summary, indent=2))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
