"""Where a request's time to first token goes: trace whole requests through both
workers and print, per milestone, when each request reached it after the client sent it.

    python -m scripts.trace_requests --out $OUT                 # random Llama-2-7B shape, CUDA
    python -m scripts.trace_requests --out $OUT --kernels       # and the profiler's kernel traces

Starts the daemon, sends `--requests` sequential requests after a warm-up through a raw
protocol client, and records the workers' host marks (`marks-*.json`,
hybridd/runtime/step_trace.py) and `timeline.json` (each request's send and chunks),
all on one clock (CLOCK_MONOTONIC). `milestones.json` and the printed table give each
milestone's median offset from the send; the inter-token gaps are given at the client
and as the context generator sent the chunks. `--client-spin` has the client poll its
socket (`alternate`: every other request, reported apart as `milestones-spin.json`).
`--kernels` writes the profiler's traces too (`python -m hybridd.bench.breakdown
--trace` reads them); the profiler slows the host path, so the marks are then not the
untraced timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import zmq

from hybridd.protocol import codec
from hybridd.bench.daemon import Daemon, dealer
from hybridd.bench.random_checkpoint import make_checkpoint


class RawClient:
    """One DEALER and the daemon's own codec (protocol/SPEC.md): no SDK between the
    client's clock and the socket."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self.socket = dealer(context, endpoint)

    def send(self, message: dict) -> None:
        self.socket.send(codec.encode({"v": 1, "id": uuid.uuid4().hex, **message}))

    def recv(self, timeout: float, spin: bool) -> dict | None:
        """The next reply, or None after `timeout` s; `spin`: poll without sleeping, so a
        reply is taken when it arrives, not when the OS wakes this thread."""
        deadline = time.monotonic() + timeout
        while not self.socket.poll(0 if spin else int(timeout * 1000)):
            if not spin or time.monotonic() > deadline:
                return None
        return codec.decode(self.socket.recv())

    def close(self) -> None:
        self.socket.close(0)


def milestones(timeline: list[dict], marks: list[tuple[str, str, int]]) -> list[tuple[str, float, float, int]]:
    """(milestone, median ms after the send, p90 ms, requests) for the workers' marks
    (role, name, ns) and the client's first chunk, in the order reached, over the
    requests that reached every milestone (a request at a trace window's edge has only
    some marks; medians over one set of requests keep the order each request took)."""
    per_request: list[dict[str, float]] = []
    for request in timeline:
        end = request["next_ns"]
        sent = request["sent_ns"]
        offsets: dict[str, float] = {}
        for role, name, ns in marks:
            if ns < sent or (end is not None and ns >= end):
                continue
            offsets.setdefault(f"{role}.{name}", (ns - sent) / 1e6)  # the first time its step reached it
        offsets["client.first_chunk"] = request["chunks_ms"][0]
        per_request.append(offsets)
    names = set().union(*per_request) if per_request else set()
    complete = [offsets for offsets in per_request if set(offsets) == names]
    rows = []
    for key in names:
        values = sorted(offsets[key] for offsets in complete)
        if values:
            rows.append((key, statistics.median(values), values[int(0.9 * (len(values) - 1))], len(values)))
    return sorted(rows, key=lambda row: row[1])


def _settings(text: str) -> dict:
    """--config: a JSON object of daemon settings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of settings, got {text!r}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--prompt-len", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="pause between a request's end and the next send")
    parser.add_argument("--client-spin", choices=("off", "on", "alternate"), default="off",
                        help="the client polls its socket without sleeping (alternate: every other request)")
    parser.add_argument("--kernels", action="store_true", help="also record the profiler's kernel traces")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--config", type=_settings, default={},
                        help="daemon settings as a JSON object, e.g. '{\"busy_poll_s\": 0.05}'")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    steps_per_request = args.max_tokens  # a prefill, then a decode step per further token
    os.environ["HYBRIDD_TRACE_DIR"] = str(args.out)
    os.environ["HYBRIDD_TRACE_MARKS"] = "1"
    os.environ["HYBRIDD_TRACE_KERNELS"] = "1" if args.kernels else "0"
    os.environ["HYBRIDD_TRACE_CPU"] = "1"
    os.environ["HYBRIDD_TRACE_WARMUP"] = str(args.warmup_requests * steps_per_request + 1)
    os.environ["HYBRIDD_TRACE_STEPS"] = str(args.requests * steps_per_request)
    if args.model is None:
        args.model = make_checkpoint(Path(f"/tmp/hybridd-{args.preset}-normal-random"), args.preset, device=args.device)
    overrides = {"kv_cache_memory_fraction": 0.3} if args.device == "cuda" else {}
    overrides.update(args.config)
    daemon = Daemon({"model": str(args.model), "device": args.device, "compile_sampler": args.device == "cuda",
                     "log_level": "warning", **overrides}, ready_timeout=600)
    timeline, client, context = [], None, zmq.Context()
    try:
        client = RawClient(context, daemon.endpoint)
        time.sleep(3)  # background prefill capture
        for i in range(args.warmup_requests + args.requests + 2):
            time.sleep(args.gap_ms / 1e3)
            sent_ns = time.perf_counter_ns()
            client.send({"type": "generate", "prompt_token_ids": [5 + (7 * i + j) % 1000 for j in range(args.prompt_len)],
                         "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0}, "stream": True})
            chunks = []
            spin = args.client_spin == "on" or (args.client_spin == "alternate" and i % 2 == 1)
            while True:
                message = client.recv(60, spin=spin)
                if message is None:
                    raise TimeoutError("no reply")
                chunks.append(time.perf_counter_ns())
                if message.get("type") != "chunk":
                    break
            timeline.append({"request": i, "sent_ns": sent_ns, "spin": spin,
                             "chunks_ms": [(t - sent_ns) / 1e6 for t in chunks]})
        time.sleep(1)
    finally:
        if client is not None:
            client.close()
        context.term()
        daemon.close()
    for request, after in zip(timeline, timeline[1:] + [None]):
        request["next_ns"] = None if after is None else after["sent_ns"]  # where its marks end
    (args.out / "timeline.json").write_text(json.dumps(timeline, indent=1))
    marks = []
    for path in sorted(args.out.glob("marks-*.json")):
        data = json.loads(path.read_text())
        marks += [(data["role"], name, ns) for name, _step, ns in data["marks"]]
    marks.sort(key=lambda m: m[2])
    traced = timeline[args.warmup_requests:args.warmup_requests + args.requests]
    for spin in sorted({r["spin"] for r in traced}):
        print(f"client spinning: {spin}")
        report(args, [r for r in traced if r["spin"] == spin], marks, "-spin" if spin else "")
    return 0


def report(args, traced: list[dict], marks: list[tuple[str, str, int]], suffix: str) -> None:
    """The milestone table and the client's TTFT and ITL over the `traced` requests."""
    rows = milestones(traced, marks)
    (args.out / f"milestones{suffix}.json").write_text(json.dumps(
        [{"milestone": k, "median_ms": m, "p90_ms": p, "requests": n} for k, m, p, n in rows], indent=1))
    print(f"{len(traced)} requests of {args.prompt_len} tokens, max_tokens {args.max_tokens}; "
          f"ms after the client's send (median, p90), and the step from the milestone before")
    previous = 0.0
    for key, median, p90, n in rows:
        print(f"  {key:28s} {median:8.3f} {p90:8.3f}   +{median - previous:6.3f}   (n={n})")
        previous = median
    ttft = sorted(r["chunks_ms"][0] for r in traced)
    sends = [ns for role, name, ns in marks if role == "context" and name == "chunk_send"]
    # The last message is the final reply, not a token: the gaps run between token chunks.
    gaps = sorted(b - a for r in traced for a, b in zip(r["chunks_ms"][:-2], r["chunks_ms"][1:-1]))
    print(f"TTFT p50 {statistics.median(ttft):.3f} ms" + (f"; {_itl(gaps)}" if gaps else ""))
    # The same gaps as the context generator sent the chunks: what the client adds is the
    # difference.
    sent_gaps = []
    for r in traced:
        start, end = r["sent_ns"], r["sent_ns"] + r["chunks_ms"][-1] * 1e6
        own = [ns for ns in sends if start <= ns <= end]
        sent_gaps += [(b - a) / 1e6 for a, b in zip(own, own[1:])]
    if sent_gaps:
        print(f"chunks as sent: {_itl(sorted(sent_gaps))}")


def _itl(gaps: list[float]) -> str:
    """p50, p99 and max of sorted gaps in ms, and their count."""
    return (f"ITL p50 {statistics.median(gaps):.3f} ms, p99 {gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]:.3f}"
            f" ms, max {gaps[-1]:.3f} ms over {len(gaps)} gaps")


if __name__ == "__main__":
    sys.exit(main())
