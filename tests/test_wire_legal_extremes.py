"""Legal requests at the edges of the spec, sent as raw msgpack over a raw DEALER to
the real daemon (`hybridd start`, embedded model): each gets a clear error or a valid
result, running requests of other clients are unaffected, and no worker dies (the
worker pids and restart counters in `status` do not change)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from tests.test_client_sdk import RunningDaemon, run_daemon

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
