"""Prefill graphs captured while decode streams run, forced through the daemon: ITL of a
batch-1 stream during those captures against steady state (the bench's `capture_evict`
part).

The daemon runs with prefill buckets 16 < X < Y and a graph memory budget that holds the
decode graphs, 16 and one of X, Y but not both. While one client streams tokens without
pause, another sends prompts of the bucket not captured (each a decode prompt short of
it) until its demand exceeds the captured one's, so the background thread evicts the
captured graph and captures the demanded one during decode. A cycle counts when the
daemon's statistics show the capture within CAPTURE_WAIT_S; its window runs from the
last trigger sent to its first token + the capture's duration + 50 ms. Gaps inside a
counted window are "during", gaps outside every window "steady"; gaps overlapping a
trigger's own prefill or an uncounted window are left out.

    python -m hybridd.bench.capture --replan < at_ready.json

prints the budget the phase restarts the daemon with for a status taken at ready
(`{"status": ..., "x_bucket": ..., "need_y_bytes": ..., "budget_mb": ...}`),
or null where the budget in force stands.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hybridd.bench.timing import StreamRecord, itl_summary, random_prompt, ratio

MiB = 1 << 20
SMALL = 16  # the bucket of the decode stream's own prompts
DECODE_PROMPT = 8  # tokens of each decode stream's prompt
# Bucket pairs tried in order: the first whose estimates force an eviction is used.
PAIRS = ((512, 1024), (256, 512), (1024, 2048), (128, 256))
DECODE_BUCKETS = [1, 2]  # one decode stream plus one trigger prompt at a time
STATS_WAIT_S = 1.3  # longer than the graph generator's statistics interval (1 s)
CAPTURE_WAIT_S = 8.0  # the longest a forced capture is waited for


def plan_budget(model: Path, cuda: bool, max_prefill_seqs: int, max_tokens: int) -> dict:
    """Choose X, Y and a budget (MiB) by the graph runner's own activation estimates: the
    decode graphs, bucket 16 and Y fit; with X as well they do not."""
    from hybridd.model.config import ModelConfig
    from hybridd.runtime.graph_memory import activation_bytes

    config = ModelConfig.from_dir(model)
    elem = 2 if cuda else 4
    # On CUDA the decode graphs share the pool and take far less than the activation estimate (the
    # per-bucket `graph memory` lines in docs/lab/bench_history.md): a fixed allowance; the estimate on the CPU.
    decode = 8 * MiB if cuda else sum(activation_bytes(config, b, b, elem) for b in DECODE_BUCKETS)
    fixed = decode + activation_bytes(config, SMALL, max_prefill_seqs, elem)
    for x, y in PAIRS:
        if y > max_tokens or y >= config.max_model_len:  # a prompt of Y tokens plus one generated must fit
            continue
        need_x = activation_bytes(config, x, max_prefill_seqs, elem)
        need_y = activation_bytes(config, y, max_prefill_seqs, elem)
        budget_mb = math.ceil((fixed + need_y) / MiB)
        if fixed + need_x + need_y > budget_mb * MiB:
            return {"x": x, "y": y, "budget_mb": budget_mb, "need_x_bytes": need_x, "need_y_bytes": need_y,
                    "fixed_bytes": fixed}
    raise RuntimeError("no prefill bucket pair whose graphs cannot share a budget that holds either one")


def replanned_budget_mb(status: dict, x_bucket: dict, need_y: int, budget_mb: int) -> int | None:
    """The least budget (MiB) under which Y fits once X is evicted, from the graph bytes
    measured at ready (`status`, X's bucket entry), or None where the budget in force is it.

    A graph's measured cost is the growth of the pool during its capture, so the graphs
    held at ready may be charged for more than their own activations (then Y would not
    fit beside them even with X evicted) or for less than the plan's estimate (then,
    once Y has been captured and its real cost is known, X and Y could fit together and
    nothing more would be forced). The least budget that admits Y by the graph runner's
    own estimate leaves no room for X beside Y unless their real costs together come
    under that estimate."""
    kept = (status.get("graph_bytes") or 0) - ((x_bucket.get("bytes") or 0) if x_bucket.get("captured") else 0)
    least = math.ceil((kept + need_y) / MiB)
    return None if least == budget_mb else least


def start_settled(server_factory, client_factory, overrides: dict, x: int):
    """(server, control client, prefill buckets, status) once the captures that follow
    ready are done: buckets 16 and X captured or refused (or 30 s), then a fresh report."""
    server = server_factory(**overrides)
    try:
        ctl = client_factory(server.endpoint)
        settle_end = time.perf_counter() + 30
        while time.perf_counter() < settle_end:
            b = prefill_buckets(ctl.status())
            if all(b.get(s, {}).get("captured") or b.get(s, {}).get("disabled") for s in (SMALL, x)):
                break
            time.sleep(0.2)
        time.sleep(STATS_WAIT_S)
        status = ctl.status()
    except BaseException:
        server.close()
        raise
    return server, ctl, prefill_buckets(status), status


def prefill_buckets(status: dict) -> dict[int, dict]:
    return {b["size"]: b for b in status.get("buckets", []) if b.get("kind") == "prefill"}


def measure_capture_under_eviction(client_factory, model: Path, cuda: bool, vocab: int, quick: bool,
                                   server_factory, notes: list[str]) -> dict:
    """Start the daemon (server_factory(**overrides)), run the phase, return its figures."""
    from hybridd.config import Config
    from hybridd.stats import percentile

    defaults = Config()
    plan = plan_budget(model, cuda, defaults.max_prefill_seqs, defaults.max_prefill_tokens)
    x, y = plan["x"], plan["y"]
    # A step beside the decode stream takes a trigger whole (not in chunks): its demand is its bucket's.
    overrides = {"decode_buckets": DECODE_BUCKETS, "max_batch": max(DECODE_BUCKETS), "chunk_tokens": y,
                 "prefill_buckets": [SMALL, x, y], "graph_memory_budget_mb": plan["budget_mb"]}
    result: dict[str, Any] = {"plan": plan, "config": overrides}
    server = ctl = decoder = None
    stop = threading.Event()
    records: list[StreamRecord] = []
    failures: list[str] = []
    windows: list[dict] = []
    dropped: list[tuple[float, float]] = []
    triggers: list[StreamRecord] = []
    try:
        server, ctl, buckets, status = start_settled(server_factory, client_factory, overrides, x)
        budget_mb = replanned_budget_mb(status, buckets.get(x) or {}, plan["need_y_bytes"],
                                        overrides["graph_memory_budget_mb"])
        if budget_mb is not None:
            result["replanned"] = {"graph_bytes_at_ready": status.get("graph_bytes"), "budget_mb": budget_mb}
            ctl.close()
            server.close()
            server = ctl = None
            overrides = {**overrides, "graph_memory_budget_mb": budget_mb}
            result["config"] = overrides
            server, ctl, buckets, status = start_settled(server_factory, client_factory, overrides, x)
        decoder = client_factory(server.endpoint)
        result["at_ready"] = {s: {k: b.get(k) for k in ("captured", "bytes", "demand", "disabled")}
                              for s, b in buckets.items()}
        rng = random.Random(11)
        tokens = 64 if quick else 256

        def decode_loop() -> None:
            drng = random.Random(12)
            try:
                while not stop.is_set():
                    records.append(decoder.stream(random_prompt(drng, DECODE_PROMPT, vocab), tokens))
            except Exception as exc:  # noted; the main thread ends the phase
                failures.append(f"{type(exc).__name__}: {exc}")

        thread = threading.Thread(target=decode_loop, name="bench-decode", daemon=True)
        thread.start()
        decode_from = time.perf_counter()
        time.sleep(1.0 if quick else 2.0)  # steady decode before the first forced capture
        for _ in range(2 if quick else 4):
            if failures:
                break
            pending = [s for s in (y, x) if not buckets[s].get("captured") and not buckets[s].get("disabled")]
            if not pending:
                notes.append("capture_evict: both buckets captured (no eviction was needed), nothing left to force")
                break
            target = pending[0]
            other = x if target == y else y
            before = buckets[target].get("captures", 0)
            # The daemon's counts (a report at most a second old: it can only have counted
            # more since, so this sends at least as many as needed).
            demand = {s: buckets[s].get("demand", 0) for s in (x, y)}
            while True:
                # A trigger short of its bucket by a decode prompt: a step that also takes
                # the decode stream's next prompt stays in the bucket, and counts for it.
                triggers.append(ctl.stream(random_prompt(rng, target - DECODE_PROMPT, vocab), 1))
                demand[target] += 1
                if demand[target] > demand[other]:
                    break
            last = triggers[-1]
            seen_by = time.perf_counter() + CAPTURE_WAIT_S
            while True:  # the statistics arrive once a second: poll until they show the capture
                time.sleep(0.3)
                buckets = prefill_buckets(ctl.status())
                if buckets[target].get("captures", 0) > before or time.perf_counter() > seen_by:
                    break
            start = last.sent
            end = (last.times[0] if last.times else last.sent) + (buckets[target].get("capture_s") or 0.0) + 0.05
            if buckets[target].get("captures", 0) > before:
                windows.append({"bucket": target, "start": start, "end": end,
                                "first_token": last.times[0] if last.times else last.sent,
                                "capture_s": buckets[target].get("capture_s"), "bytes": buckets[target].get("bytes")})
            else:
                dropped.append((start, end))
            time.sleep(0.5 if quick else 1.0)
        stop.set()
        thread.join(120)
        final = prefill_buckets(ctl.status())
    finally:
        stop.set()
        for c in (ctl, decoder):
            if c is not None:
                c.close()
        if server is not None:
            server.close()
    if failures:
        raise RuntimeError(f"decode stream failed: {failures[0]}")
    blocked = [(t.sent, (t.times[0] if t.times else t.sent) + 0.001) for t in triggers] + dropped
    during, steady = [], []
    during_gaps = []  # (gap, its start, its window)
    for record in records:
        for a, b in zip(record.times, record.times[1:]):
            if a < decode_from or any(a < e and b > s for s, e in blocked):
                continue
            window = next((w for w in windows if a < w["end"] and b > w["start"]), None)
            if window is None:
                steady.append(b - a)
            else:
                during.append(b - a)
                during_gaps.append((b - a, a, window))
    result.update({
        "during": itl_summary(during), "steady": itl_summary(steady),
        "p99_ratio": ratio(percentile(during, 99), percentile(steady, 99)) if len(during) >= 5 else None,
        "p50_ratio": ratio(percentile(during, 50), percentile(steady, 50)) if during else None,
        "captures_during_decode": len(windows), "cycles_without_capture": len(dropped),
        "capture_windows": [{k: (v - decode_from if k in ("start", "end", "first_token") else v) for k, v in w.items()}
                            for w in windows],
        # Where the longest gaps inside the windows sit: from the trigger prompt's first
        # token, after which the capture runs (a gap before it overlaps the prompt's own
        # prefill and is left out).
        "longest_during_gaps": [{"gap_s": gap, "after_first_token_s": start - w["first_token"], "bucket": w["bucket"],
                                 "capture_s": w["capture_s"]}
                                for gap, start, w in sorted(during_gaps, key=lambda x: -x[0])[:3]],
        "evictions": sum(b.get("evictions", 0) for b in final.values()),
        "triggers": len(triggers), "decode_streams": len(records), "tokens_per_stream": tokens,
    })
    if len(during) < 5:
        result["note"] = (f"{len(windows)} captures during decode gave {len(during)} decode gaps inside their "
                          f"windows: too few for a p99")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replan", action="store_true", required=True,
                        help="read the figures at ready as JSON on stdin, print the budget (MiB) or null")
    parser.parse_args()
    try:
        at_ready = json.load(sys.stdin)
        budget = replanned_budget_mb(at_ready["status"], at_ready["x_bucket"], at_ready["need_y_bytes"],
                                     at_ready["budget_mb"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        parser.error(f"stdin: a JSON object with status, x_bucket, need_y_bytes and budget_mb ({exc!r})")
    print(json.dumps(budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
