"""Load the daemon over the wire with clients that misbehave beside ones that do not,
and count what went wrong: requests lost, hung or mismatched, and the inter-token
latency of the well-behaved streams.

    python -m scripts.load_wire --start --requests 2048 --clients 32
    python -m scripts.load_wire --endpoint ipc:///run/hybridd/hybridd.sock

Clients (raw pyzmq + msgpack, one DEALER each): most are well-behaved greedy streams,
some of which cancel after a few chunks; one disconnects in the middle of its requests
and reconnects; one reads slowly (paused between replies, several long streams in
flight); one sends maximal prompts (1,048,576 characters, refused as too long for the
model). Every greedy request is compared with the same request run alone first.

- lost: a reply sequence that breaks the spec (a gap in chunk indices, chunks that do
  not add up to the final text, a terminal reply missing where the session lives);
- hung: no terminal reply within the deadline;
- mismatched: a completed greedy request whose tokens differ from the reference (or a
  cancelled one whose tokens are not a prefix of it).
At the end nothing may still run (orphans), the KV blocks must be back, and the worker
pids and restart counters must be unchanged. Prints a JSON report; exits 1 on any fault.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from hybridd.stats import percentile

from hybridd.bench import daemon
from hybridd.bench.daemon import pack

PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:", "KING HENRY:", "O, what a", "To be, or not"]
MAX_TOKENS = [8, 16, 32]
MAX_PROMPT_CHARS = 1_048_576
DEADLINE_S = 180.0


class Conn:
    """One session, as SPEC §1.1 says a client must run it: a dropped connection ends
    every request in flight on it as `engine_dead`."""

    def __init__(self, context: zmq.Context, endpoint: str, rcvhwm: int | None = None) -> None:
        self.context, self.endpoint = context, endpoint
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.socket.connect(endpoint)
        self.connected = False
        self.dropped = False

    def send(self, message: dict) -> str:
        rid = message.setdefault("id", uuid.uuid4().hex)
        self.socket.send(pack({"v": 1} | message))
        return rid

    def recv(self, timeout_s: float) -> dict | None:
        """The next reply; an `engine_dead` error (marked `dropped`) once the
        connection drops; None on timeout."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            if self.dropped:
                return {"type": "error", "code": "engine_dead", "id": None, "dropped": True}
            events = dict(poller.poll(int(max(0.0, deadline - time.monotonic()) * 1000)))
            if self.socket in events:
                return msgpack.unpackb(self.socket.recv())
            if self.monitor in events:
                event = parse_monitor_message(self.monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.connected = True
                elif event == zmq.EVENT_DISCONNECTED and self.connected:
                    self.dropped = True
                continue
            if time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close()


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    refused: dict = field(default_factory=dict)
    lost: list = field(default_factory=list)
    hung: list = field(default_factory=list)
    mismatched: list = field(default_factory=list)
    engine_dead: list = field(default_factory=list)  # in flight when the daemon's side failed
    abandoned: int = 0  # requests of a session that disconnected on purpose
    slow_ended: int = 0
    itl: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, value) -> None:
        with self.lock:
            getattr(self, name).append(value)

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)

    def ended(self, rid: str, final: dict | None, expected: list[int]) -> None:
        """Count a request's terminal reply: refused (by code), cancelled (its tokens a prefix
        of `expected`) or completed (its tokens `expected`)."""
        if final is None:
            return
        if final["type"] == "error":
            with self.lock:
                self.refused[final["code"]] = self.refused.get(final["code"], 0) + 1
            return
        cancelled = final["finish_reason"] == "cancelled"
        self.count("cancelled" if cancelled else "completed")
        if final["token_ids"] != (expected[:len(final["token_ids"])] if cancelled else expected):
            self.add("mismatched", rid)


def generate(prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {"type": "generate", "prompt": prompt, "stream": stream,
            "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


def collect(conn: Conn, rid: str, tally: Tally, *, pause_s: float = 0.0, cancel_after: int | None = None,
            itl: bool = False) -> tuple[dict | None, list[dict]]:
    """Read one request's replies; check the spec's sequence rules."""
    chunks, last, gaps = [], None, []
    deadline = time.monotonic() + DEADLINE_S
    while True:
        reply = conn.recv(deadline - time.monotonic())
        if reply is None:
            tally.add("hung", rid)
            return None, chunks
        if reply.get("dropped"):
            tally.add("engine_dead", rid)
            return None, chunks
        if reply["id"] != rid:
            tally.add("lost", f"{rid}: a reply for another id {reply['id']!r}")
            continue
        now = time.monotonic()
        if reply["type"] == "chunk":
            if reply["index"] != len(chunks):
                tally.add("lost", f"{rid}: chunk {reply['index']} after {len(chunks)} chunks")
            chunks.append(reply)
            if last is not None:
                gaps.append(now - last)
            last = now
            if cancel_after is not None and len(chunks) == cancel_after:
                conn.send({"type": "cancel", "target": rid})
            if pause_s:
                time.sleep(pause_s)
            continue
        if reply["type"] == "final":
            text = "".join(c["text"] for c in chunks)
            ids = [t for c in chunks for t in c["token_ids"]]
            if chunks and (text != reply["text"] or reply["token_ids"][: len(ids)] != ids):
                tally.add("lost", f"{rid}: chunks do not add up to the final")
        if itl:
            with tally.lock:
                tally.itl.extend(gaps)
        return reply, chunks


def well_behaved(context, endpoint, jobs, tally, references, rng: random.Random) -> None:
    conn = Conn(context, endpoint)
    try:
        for prompt, max_tokens in jobs:
            cancel_after = rng.randint(1, 4) if rng.random() < 0.1 else None
            rid = conn.send(generate(prompt, max_tokens))
            final, _ = collect(conn, rid, tally, cancel_after=cancel_after, itl=cancel_after is None)
            tally.count("requests")
            tally.ended(rid, final, references[(prompt, max_tokens)])
    finally:
        conn.close()


def disconnecter(context, endpoint, jobs, tally, references, rng) -> None:
    """Every third request: read two chunks, then close the socket and reconnect."""
    for n, (prompt, max_tokens) in enumerate(jobs):
        conn = Conn(context, endpoint)
        rid = conn.send(generate(prompt, 64 if n % 3 == 0 else max_tokens))
        tally.count("requests")
        if n % 3 == 0:
            for _ in range(2):
                conn.recv(DEADLINE_S)
            conn.close()
            tally.count("abandoned")
            continue
        final, _ = collect(conn, rid, tally)
        conn.close()
        if final is not None and final["type"] == "final":
            tally.ended(rid, final, references[(prompt, max_tokens)])


def slow_reader(context, endpoint, jobs, tally, references, rng, paused_s: float = 30.0) -> None:
    """Four long streams at a time: the first batch is not read at all for a while (its
    backlog passes the daemon's limit), later ones are read with a pause per reply."""
    conn = Conn(context, endpoint, rcvhwm=1)
    try:
        for start in range(0, len(jobs), 4):
            batch = jobs[start:start + 4]
            ids = [conn.send(generate(prompt, 900)) for prompt, _ in batch]
            if start == 0:
                time.sleep(paused_s)
            tally.count("requests", len(ids))
            done: dict[str, dict | None] = {}
            deadline = time.monotonic() + DEADLINE_S * 2
            counts = dict.fromkeys(ids, 0)
            while len(done) < len(ids):
                reply = conn.recv(deadline - time.monotonic())
                if reply is None:
                    for rid in set(ids) - set(done):
                        tally.add("hung", rid)
                    break
                if reply.get("dropped"):
                    for rid in set(ids) - set(done):
                        tally.add("engine_dead", rid)
                    break
                time.sleep(0.005)
                rid = reply["id"]
                if rid not in counts:  # a late reply of an earlier batch that was counted as hung
                    continue
                if reply["type"] == "chunk":
                    if reply["index"] != counts[rid]:
                        tally.add("lost", f"{rid}: slow reader chunk {reply['index']} after {counts[rid]}")
                    counts[rid] += 1
                    continue
                done[rid] = reply
                if reply["type"] == "error":
                    tally.count("slow_ended", reply["code"] == "overloaded")
                else:
                    tally.count("completed")
    finally:
        conn.close()


def maximal_prompts(context, endpoint, jobs, tally, references, rng) -> None:
    conn = Conn(context, endpoint)
    try:
        for n, _ in enumerate(jobs):
            prompt = ("€" if n % 2 else "a") * MAX_PROMPT_CHARS  # 3 MiB at most: within the 4 MiB frame
            rid = conn.send(generate(prompt, 8))
            final, _ = collect(conn, rid, tally)
            tally.count("requests")
            if final is not None and final["type"] == "error":
                tally.ended(rid, final, [])
    finally:
        conn.close()


def references_of(context, endpoint) -> dict:
    """Each greedy (prompt, max_tokens) run alone."""
    conn = Conn(context, endpoint)
    references = {}
    try:
        for prompt in PROMPTS:
            rid = conn.send(generate(prompt, max(MAX_TOKENS), stream=False))
            reply = conn.recv(DEADLINE_S)
            assert reply is not None and reply["id"] == rid and reply["type"] == "final", reply
            for max_tokens in MAX_TOKENS:
                references[(prompt, max_tokens)] = reply["token_ids"][:max_tokens]
    finally:
        conn.close()
    return references


def run_load(endpoint: str, requests: int = 2048, clients: int = 32, seed: int = 1, paused_s: float = 30.0,
             maximal: bool = True) -> dict:
    """The whole run; `paused_s`: how long the slow reader leaves its first batch unread;
    `maximal`: whether one client sends maximal prompts (else it is well-behaved too)."""
    rng = random.Random(seed)
    context = zmq.Context()
    before = daemon.status_of(context, endpoint)
    references = references_of(context, endpoint)
    tally = Tally()
    roles = [disconnecter, slow_reader, maximal_prompts if maximal else well_behaved] + [well_behaved] * (clients - 3)
    shares = {disconnecter: 1.0, slow_reader: 0.125, maximal_prompts: 0.1, well_behaved: 1.0}
    weight = sum(shares[r] for r in roles)
    threads = []
    started = time.monotonic()
    for n, role in enumerate(roles):
        count = max(1, round(requests * shares[role] / weight))
        jobs = [(rng.choice(PROMPTS), rng.choice(MAX_TOKENS)) for _ in range(count)]
        extra = {"paused_s": paused_s} if role is slow_reader else {}
        threads.append(threading.Thread(target=role, args=(context, endpoint, jobs, tally, references,
                                                           random.Random(seed * 1000 + n)), kwargs=extra,
                                        name=role.__name__))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    deadline = time.monotonic() + 5.0
    while True:
        after = daemon.status_of(context, endpoint)
        if after["requests"]["running"] == 0 and after["requests"]["queued"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    context.destroy(linger=0)
    orphans = after["requests"]["running"] + after["requests"]["queued"]
    report = {
        "requests": tally.requests, "clients": clients, "seconds": round(seconds, 1),
        "completed": tally.completed, "cancelled": tally.cancelled, "disconnected_on_purpose": tally.abandoned,
        "slow_reader_ended_overloaded": tally.slow_ended, "refused": tally.refused,
        "lost": len(tally.lost), "hung": len(tally.hung), "mismatched": len(tally.mismatched),
        "engine_dead": len(tally.engine_dead),
        "examples": (tally.lost + tally.hung + tally.mismatched)[:10],
        "orphans_after": orphans,
        "kv_blocks_used": {"before": before["kv_blocks"]["used"], "after": after["kv_blocks"]["used"]},
        "workers_unchanged": after["workers"] == before["workers"],
        "itl_well_behaved_s": {"p50": percentile(tally.itl, 50), "p90": percentile(tally.itl, 90),
                               "p99": percentile(tally.itl, 99), "max": max(tally.itl, default=None),
                               "samples": len(tally.itl)},
    }
    report["ok"] = (not tally.lost and not tally.hung and not tally.mismatched and not tally.engine_dead
                    and orphans == 0
                    and report["workers_unchanged"]
                    and report["kv_blocks_used"]["after"] == report["kv_blocks_used"]["before"])
    return report


def main() -> int:
    parser = daemon.argument_parser(__doc__)
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--paused-s", type=float, default=30.0, help="how long the slow reader leaves its first "
                        "batch unread")
    parser.add_argument("--maximal", action=argparse.BooleanOptionalAction, default=True,
                        help="one client sends maximal prompts (--no-maximal: it is well-behaved too)")
    args = parser.parse_args()
    if args.paused_s < 0:
        parser.error(f"--paused-s must be 0 or more, got {args.paused_s}")
    with daemon.daemon_endpoint(args) as endpoint:
        report = run_load(endpoint, args.requests, args.clients, args.seed, args.paused_s, args.maximal)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
