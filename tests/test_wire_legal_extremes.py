"""Legal requests at the edges of the spec, sent as raw msgpack over a raw DEALER to
the real daemon (`hybridd start`, embedded model): each gets a clear error or a valid
result, running requests of other clients are unaffected, and no worker dies (the
worker pids and restart counters in `status` do not change)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

import hybridd
from hybridd.stats import percentile
from tests.daemon import RunningDaemon, run_daemon
from tests.host_load import load_factor

VOCAB = 4096  # the embedded model's
REPLY_TIMEOUT_S = 60.0

# Spec-valid sampling parameters whose float32 value degenerates: each of these once
# killed the context generator (the top-k/top-p cut indexed -1).
DEGENERATE_SAMPLING = [
    {"top_p": 1e-300},
    {"top_p": 5e-324},
    {"temperature": 1e-40, "top_p": 0.9},
    {"repetition_penalty": 5e-324, "top_p": 0.9},
    {"temperature": 5e-324},
    {"temperature": 1e-40, "top_k": 1},
    {"temperature": 1.7976931348623157e308, "top_p": 0.5},
    {"repetition_penalty": 1.7976931348623157e308, "top_p": 0.5},
    {"repetition_penalty": 1e-300, "temperature": 0},
    {"top_p": 1 - 1e-9, "top_k": 2**31 - 1},
    {"presence_penalty": 5e-324, "frequency_penalty": -5e-324, "top_p": 1e-45},
    {"presence_penalty": 2, "frequency_penalty": 2, "repetition_penalty": 1e-38, "temperature": 1e-38,
     "top_p": 1e-38, "top_k": 1},
]


class RawClient:
    """One DEALER speaking msgpack maps, nothing from hybridd."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.pending: list[dict] = []

    def send(self, message: dict) -> str:
        message = {"v": 1, "id": uuid.uuid4().hex, **message}
        self.socket.send(msgpack.packb(message, use_bin_type=True))
        return message["id"]

    def next_reply(self, rid: str, timeout: float = REPLY_TIMEOUT_S) -> dict:
        for i, reply in enumerate(self.pending):
            if reply["id"] == rid:
                return self.pending.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.socket.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                break
            reply = msgpack.unpackb(self.socket.recv(), raw=False)
            if reply["id"] == rid:
                return reply
            self.pending.append(reply)
        raise AssertionError(f"no reply for {rid} within {timeout} s")

    def terminal(self, rid: str) -> tuple[dict, list[dict]]:
        chunks = []
        while (reply := self.next_reply(rid))["type"] == "chunk":
            chunks.append(reply)
        return reply, chunks

    def status(self) -> dict:
        reply = self.next_reply(self.send({"type": "status"}))
        assert reply["type"] == "status_reply", reply
        return reply["status"]

    def close(self) -> None:
        self.socket.close()


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    # Generous heartbeats: on a busy CI host a worker can stall for seconds.
    with run_daemon("--heartbeat-interval-s", "2") as running:
        yield running


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def workers(status: dict) -> dict:
    return {name: (w["pid"], w["restarts"]) for name, w in status["workers"].items()}


def assert_valid_final(reply: dict, chunks: list[dict], max_tokens: int) -> None:
    assert reply["type"] == "final", reply
    assert reply["finish_reason"] in ("length", "stop"), reply
    assert 1 <= len(reply["token_ids"]) <= max_tokens
    assert all(0 <= t < VOCAB for t in reply["token_ids"])
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert "".join(c["text"] for c in chunks) == reply["text"]


def test_degenerate_float_parameters_are_served_and_kill_nothing(daemon, context):
    client, bystander = RawClient(context, daemon.endpoint), RawClient(context, daemon.endpoint)
    before = workers(client.status())
    # A long stream of another client runs through the whole corpus.
    running = bystander.send({"type": "generate", "prompt": "ROMEO:",
                              "sampling": {"max_tokens": 400, "temperature": 0, "ignore_eos": True}})
    assert bystander.next_reply(running)["type"] == "chunk"
    sent = [(sampling, client.send({"type": "generate", "prompt": "JULIET:",
                                    "sampling": {"max_tokens": 8, "ignore_eos": True, **sampling}}))
            for sampling in DEGENERATE_SAMPLING]
    for sampling, rid in sent:
        reply, chunks = client.terminal(rid)
        assert reply["type"] == "final", (sampling, reply)
        assert_valid_final(reply, chunks, 8)
        assert reply["finish_reason"] == "length", (sampling, reply)
    final, _ = bystander.terminal(running)
    assert final["type"] == "final" and final["finish_reason"] == "length" and len(final["token_ids"]) == 400
    assert workers(client.status()) == before


def test_smallest_top_p_draws_the_greedy_tokens(daemon, context):
    """top_p that rounds to 0 in float32 keeps only the most probable token: the
    output is the greedy output, whatever the seed."""
    client = RawClient(context, daemon.endpoint)
    prompt = {"type": "generate", "prompt": "KING HENRY:", "stream": False}
    greedy, _ = client.terminal(client.send(prompt | {"sampling": {"max_tokens": 12, "temperature": 0}}))
    for top_p, seed in ((5e-324, 1), (1e-300, 2), (1e-40, 3)):
        reply, _ = client.terminal(client.send(prompt | {"sampling": {"max_tokens": 12, "top_p": top_p,
                                                                      "seed": seed}}))
        assert reply["token_ids"] == greedy["token_ids"], top_p


def _emoji_heavy(chars: int) -> str:
    """A prompt of exactly `chars` code points, mostly 4-byte emoji, under 4 MiB of UTF-8."""
    unit = "😀🎉🙂 ab "  # 7 code points, 16 bytes
    return (unit * (chars // len(unit) + 1))[:chars]


class Flood:
    """One client sending maximal prompts while `on` is set, from a thread of its
    own: each after the previous one's reply, a set of them every `PAUSE_S` (the
    daemon's CPU time for them is then a small share of a busy 2-core host: the
    test is about the loop waiting for them, not about CPU contention)."""

    PAUSE_S = 0.15

    def __init__(self, context: zmq.Context, endpoint: str, frames: list[bytes]):
        self.on = threading.Event()
        self.stop = threading.Event()
        self.replies: list[dict] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(context, endpoint, frames), daemon=True)
        self.thread.start()

    def _run(self, context: zmq.Context, endpoint: str, frames: list[bytes]) -> None:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            while not self.stop.is_set():
                if not self.on.wait(0.02):
                    continue
                for frame in frames:
                    sock.send(frame, copy=False)
                    assert sock.poll(REPLY_TIMEOUT_S * 1000), "no reply to a maximal prompt"
                    self.replies.append(msgpack.unpackb(sock.recv(), raw=False))
                self.stop.wait(self.PAUSE_S)
        except BaseException as error:  # reported by the test's thread
            self.errors.append(error)
        finally:
            sock.close()

    def close(self) -> None:
        self.stop.set()
        self.on.clear()
        self.thread.join(REPLY_TIMEOUT_S)


def _itl_during_and_between_bursts(streams: list[RawClient], flood: Flood, rounds: int, phase_s: float):
    """Inter-token gaps of the running streams, split into those that overlap a
    flood burst and those clear of every burst: quiet and burst phases alternate,
    so both kinds see the same busy host."""
    request = {"type": "generate", "prompt": "ROMEO:", "sampling": {"max_tokens": 900, "temperature": 0,
                                                                   "ignore_eos": True}}
    poller = zmq.Poller()
    by_socket = {client.socket: client for client in streams}
    for client in streams:
        poller.register(client.socket, zmq.POLLIN)
    running = {id(client): client.send(request) for client in streams}
    last: dict[int, float] = {}
    gaps: list[tuple[float, float]] = []
    bursts: list[tuple[float, float]] = []
    start = time.monotonic()
    end = start + (2 * rounds + 1) * phase_s
    burst_start = None
    while (now := time.monotonic()) < end:
        in_burst = int((now - start) / phase_s) % 2 == 1
        if in_burst and burst_start is None:
            burst_start = now
            flood.on.set()
        elif not in_burst and burst_start is not None:
            flood.on.clear()
            bursts.append((burst_start, now))
            burst_start = None
        for sock, _ in poller.poll(20):
            client = by_socket[sock]
            while sock.poll(0):
                reply = msgpack.unpackb(sock.recv(), raw=False)
                arrived = time.monotonic()
                if reply["type"] == "chunk":
                    if id(client) in last:
                        gaps.append((last[id(client)], arrived))
                    last[id(client)] = arrived
                else:
                    assert reply["type"] == "final" and reply["finish_reason"] == "length", reply
                    last.pop(id(client), None)
                    running[id(client)] = client.send(request)
    flood.on.clear()
    for client in streams:  # the streams end here, cancelled: the next round starts from an idle daemon
        client.send({"type": "cancel", "target": running[id(client)]})
        final, _ = client.terminal(running[id(client)])
        assert final["type"] == "final" and final["finish_reason"] in ("cancelled", "length"), final
    margin = 0.5  # a prompt sent just before a burst ends may still be in progress
    during = [b - a for a, b in gaps if any(a < b_end + margin and b > b_start for b_start, b_end in bursts)]
    between = [b - a for a, b in gaps if all(b < b_start or a > b_end + margin for b_start, b_end in bursts)]
    return during, between


ROUNDS = 4
MAX_P99_RATIO = 1.45


def test_maximal_prompts_do_not_slow_running_streams(daemon, context):
    """One client sends maximal legal prompts (1,048,576 characters, refused from its
    byte count; and a prompt of max_prompt_chars characters, which must be tokenized)
    in bursts. The inter-token latency of three running streams during the bursts
    stays within MAX_P99_RATIO of the same streams' between the bursts (p99 of the
    gaps of ROUNDS rounds together: one round's p99 is too noisy on a busy host).

    Measured on a 2-core host. This code: 1.02-1.19x a round and 1.09x together on an
    idle host; with every core kept busy by a spin loop, 1.21-1.31x a round, and
    0.97x and 1.05x together in two runs. A loop that tokenizes these prompts itself
    (the intake's thread bypassed): 1.50-1.92x a round idle; busy, 1.30-1.85x a round
    and 1.56x and 1.28x together. In the whole suite with every core busy this code
    reached 1.47x together, so the bound stretches with the host's load factor
    (`tests.host_load`), as the suite's other timing bounds do: on an idle host it
    is 1.45x and catches that loop; on an oversubscribed one it does not."""
    status = RawClient(context, daemon.endpoint)
    before = status.status()
    max_prompt_chars = before["max_prompt_chars"]
    frames = [msgpack.packb({"v": 1, "type": "generate", "id": f"flood-{i}", "prompt": _emoji_heavy(chars),
                             "sampling": {"max_tokens": 4}})
              for i, chars in enumerate((1_048_576, max_prompt_chars, max_prompt_chars))]
    assert all(len(f) < 4 * 1024 * 1024 for f in frames)
    flood = Flood(context, daemon.endpoint, frames)
    during: list[float] = []
    between: list[float] = []
    try:
        for _ in range(ROUNDS):
            streams = [RawClient(context, daemon.endpoint) for _ in range(3)]
            round_during, round_between = _itl_during_and_between_bursts(streams, flood, rounds=4, phase_s=1.5)
            for client in streams:
                client.close()
            assert len(round_during) > 50 and len(round_between) > 50, (len(round_during), len(round_between))
            print(f"\nITL p99 during bursts {percentile(round_during, 99) * 1e3:.1f} ms, "
                  f"between {percentile(round_between, 99) * 1e3:.1f} ms")
            during += round_during
            between += round_between
    finally:
        flood.close()
    assert not flood.errors, flood.errors
    assert flood.replies and all(
        r["type"] == "error" and r["code"] in ("too_large", "invalid_request") and r["field"] == "prompt"
        and r["message"].startswith("prompt:") and r["id"].startswith("flood-") for r in flood.replies
    ), flood.replies[:3]
    p99_during, p99_between = percentile(during, 99), percentile(between, 99)
    bound = MAX_P99_RATIO * load_factor()
    print(f"ITL p99 of {ROUNDS} rounds: during bursts {p99_during * 1e3:.1f} ms, between {p99_between * 1e3:.1f} ms "
          f"(bound {bound:.2f}x on this host)")
    assert p99_during <= bound * p99_between, (p99_during, p99_between, bound)
    assert workers(status.status()) == workers(before)


def test_overlong_id_is_answered_unattributed_and_ends_nothing(daemon, context):
    """An id of 129 characters is invalid: its error carries id "" (never a prefix),
    and a running request whose id is that prefix streams on to its own final."""
    client = RawClient(context, daemon.endpoint)
    prefix = "p" * 128
    running = {"type": "generate", "prompt": "ROMEO:", "sampling": {"max_tokens": 40, "temperature": 0,
                                                                   "ignore_eos": True}}
    client.socket.send(msgpack.packb({"v": 1, "id": prefix, **running}))
    first = client.next_reply(prefix)
    assert first["type"] == "chunk"
    for overlong in (prefix + "x", prefix + "😀", "é" * 200):
        client.socket.send(msgpack.packb({"v": 1, "id": overlong, "type": "health"}))
        error = client.next_reply("")
        assert error["type"] == "error" and error["code"] == "too_large" and error["field"] == "id", error
        assert error["message"].startswith("id:"), error
    final, chunks = client.terminal(prefix)
    assert_valid_final(final, [first, *chunks], 40)
    assert len(final["token_ids"]) == 40
    assert not [r for r in client.pending if r["id"] != ""], client.pending


def test_duplicate_id_refusal_does_not_end_the_running_request(daemon, context):
    """A generate reusing an in-flight id is refused with id "" (an error is terminal
    for its id, and that id is the running request's): the running one streams on
    and ends with its own final, nothing after it."""
    client = RawClient(context, daemon.endpoint)
    request = {"type": "generate", "prompt": "ROMEO:", "sampling": {"max_tokens": 40, "temperature": 0,
                                                                   "ignore_eos": True}}
    client.socket.send(msgpack.packb({"v": 1, "id": "same", **request}))
    first = client.next_reply("same")
    assert first["type"] == "chunk"
    client.socket.send(msgpack.packb({"v": 1, "id": "same", **request}))
    refusal = client.next_reply("")
    assert refusal["type"] == "error" and refusal["code"] == "invalid_request" and refusal["field"] == "id"
    assert refusal["message"].startswith("id:") and "'same'" in refusal["message"], refusal
    final, chunks = client.terminal("same")
    assert_valid_final(final, [first, *chunks], 40)
    assert len(final["token_ids"]) == 40
    assert not client.socket.poll(300), "a reply after the final"
    # Once ended, the id may be used again.
    again, _ = client.terminal(_send_as(client, "same", request))
    assert again["type"] == "final"


def _send_as(client: RawClient, request_id: str, message: dict) -> str:
    client.socket.send(msgpack.packb({"v": 1, "id": request_id, **message}))
    return request_id


def test_rejected_messages_are_counted_in_status(daemon, context):
    client = RawClient(context, daemon.endpoint)
    before = client.status()["rejected"]
    client.socket.send(b"\xc1")  # not msgpack
    assert client.next_reply("")["code"] == "malformed"
    client.socket.send(msgpack.packb({"v": 1, "id": "bad-top-p", "type": "generate", "prompt": "x",
                                      "sampling": {"top_p": 0}}))
    assert client.next_reply("bad-top-p")["code"] == "invalid_request"
    after = client.status()["rejected"]
    assert after["total"] == before["total"] + 2
    assert after.get("malformed", 0) == before.get("malformed", 0) + 1
    assert after.get("invalid_request", 0) == before.get("invalid_request", 0) + 1


def test_intake_encodes_prompts_as_the_model_tokenizer_does():
    """The intake's truncating Rust encoder gives the model tokenizer's ids (special
    tokens included), cut at max_model_len."""
    from hybridd.model import load_tokenizer
    from hybridd.workers.intake import Intake

    model = Path(hybridd.__file__).parent / "assets" / "tiny-shakespeare"
    reference = load_tokenizer(model)
    intake = Intake(load_tokenizer(model), max_model_len=64)
    try:
        for prompt in ("ROMEO:", " two  spaces\n\nand lines", "<s> looks special </s>", "😀🎉 héllo wörld",
                       "e\u0301 NFC-less", "a" * 500, _emoji_heavy(300)):
            assert intake.prompt_ids(prompt) == reference.encode(prompt)[:64], prompt
        assert intake.longest_token_chars == max(len(entry) for entry in reference.get_vocab())
        assert intake.max_prompt_chars == 63 * intake.longest_token_chars
    finally:
        intake.close()


def test_short_prompts_are_encoded_on_the_loop_within_a_turn_budget():
    """`encode_now` gives a short prompt's ids as the intake's thread would, on the
    calling thread; a prompt over INLINE_PROMPT_CHARS, or one past the turn's budget of
    INLINE_TURN_CHARS, is left to the thread (None) until the next turn."""
    from hybridd.model import load_tokenizer
    from hybridd.workers.intake import INLINE_PROMPT_CHARS, INLINE_TURN_CHARS, Intake

    intake = Intake(load_tokenizer(Path(hybridd.__file__).parent / "assets" / "tiny-shakespeare"), max_model_len=64)
    try:
        for prompt in ("ROMEO:", "😀🎉 héllo wörld", "<s> looks special </s>", "a" * INLINE_PROMPT_CHARS):
            intake.new_turn()
            assert intake.encode_now(prompt) == intake.prompt_ids(prompt), prompt
        intake.new_turn()
        assert intake.encode_now("a" * (INLINE_PROMPT_CHARS + 1)) is None
        spent = 0
        while spent + INLINE_PROMPT_CHARS <= INLINE_TURN_CHARS:
            assert intake.encode_now("b" * INLINE_PROMPT_CHARS) is not None
            spent += INLINE_PROMPT_CHARS
        assert intake.encode_now("c" * (INLINE_TURN_CHARS - spent + 1)) is None  # over what is left
        intake.new_turn()
        assert intake.encode_now("ROMEO:") == intake.prompt_ids("ROMEO:")
    finally:
        intake.close()


def test_prompt_too_long_once_tokenized_is_refused_alike_on_the_loop_and_the_thread(context):
    """With max_model_len 32, a prompt of more tokens than that (and few enough
    characters to pass the character bound) is refused with
    invalid_request naming `prompt`, whether it is short enough to be encoded on the
    loop or long enough to go to the intake's thread; the daemon then serves on."""
    from hybridd.workers.intake import INLINE_PROMPT_CHARS

    with run_daemon("--max-model-len", "32", "--heartbeat-interval-s", "2") as small:
        client = RawClient(context, small.endpoint)
        words = "ROMEO: what light through yonder window breaks? " * 40
        max_prompt_chars = client.status()["max_prompt_chars"]
        assert INLINE_PROMPT_CHARS + 100 <= max_prompt_chars
        for prompt in (words[:INLINE_PROMPT_CHARS], words[: INLINE_PROMPT_CHARS + 100]):
            reply, _ = client.terminal(client.send({"type": "generate", "prompt": prompt,
                                                    "sampling": {"max_tokens": 2}}))
            assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
            assert reply["field"] == "prompt" and reply["message"].startswith("prompt: has at least"), reply
        reply, _ = client.terminal(client.send({"type": "generate", "prompt": "ROMEO:",
                                                "sampling": {"max_tokens": 2, "ignore_eos": True}}))
        assert reply["type"] == "final" and len(reply["token_ids"]) == 2, reply


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_intake_thread_runs_below_the_serving_loop():
    """Tokenizing runs at a lower CPU priority than the thread that created the
    intake (the serving loop), whatever that thread's own priority (a daemon started
    under `nice` too): on a host with no idle core it takes what serving leaves."""
    from hybridd.model import load_tokenizer
    from hybridd.workers.intake import LOWEST_PRIORITY, Intake, intake_niceness

    tokenizer = load_tokenizer(Path(hybridd.__file__).parent / "assets" / "tiny-shakespeare")

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def intake_beside_a_loop_at(loop: int | None) -> tuple[int, int]:
        """(the loop's, the intake thread's) nice values, the loop's raised to `loop` first."""
        if loop is not None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), loop)
        intake = Intake(tokenizer, max_model_len=64)
        try:
            return niceness(), intake.submit(niceness).result(timeout=REPLY_TIMEOUT_S)
        finally:
            intake.close()

    results = []
    for loop in (None, min(LOWEST_PRIORITY - 1, niceness() + 5)):  # a thread's nice value only goes up
        worker = threading.Thread(target=lambda loop=loop: results.append(intake_beside_a_loop_at(loop)))
        worker.start()
        worker.join(timeout=REPLY_TIMEOUT_S)
    assert len(results) == 2, results
    for loop_nice, intake_nice in results:
        assert intake_nice == intake_niceness(loop_nice) and intake_nice > loop_nice, results


@pytest.mark.slow
def test_seeded_request_reproduces_alone_and_across_a_worker_restart(daemon, context):
    """SPEC: a seeded request sent alone gives the same completion every time,
    across restarts. Runs last in this module: it restarts the worker pair."""
    client = RawClient(context, daemon.endpoint)
    request = {"type": "generate", "prompt": "JULIET:", "stream": False,
               "sampling": {"max_tokens": 24, "temperature": 1.3, "top_p": 0.95, "seed": 4242, "ignore_eos": True}}
    first, _ = client.terminal(client.send(request))
    again, _ = client.terminal(client.send(request))
    other, _ = client.terminal(client.send(request | {"sampling": request["sampling"] | {"seed": 4243}}))
    assert first["type"] == "final" and len(first["token_ids"]) == 24
    assert again["token_ids"] == first["token_ids"]
    assert other["token_ids"] != first["token_ids"]  # the seed is what makes them equal
    before = client.status()["workers"]
    os.kill(before["context"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline, "the worker pair did not come back"
        with contextlib.suppress(AssertionError):
            status = client.next_reply(client.send({"type": "status"}), timeout=2.0)["status"]
            if status["state"] == "ready" and status["workers"]["context"]["pid"] != before["context"]["pid"]:
                break
        time.sleep(0.5)
    client.close()
    client = RawClient(context, daemon.endpoint)  # a new session: the old one died with the worker
    restarted, _ = client.terminal(client.send(request))
    assert restarted["token_ids"] == first["token_ids"] and restarted["text"] == first["text"]
