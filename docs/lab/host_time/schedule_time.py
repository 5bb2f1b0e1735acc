"""A new request's scheduling, timed in one process without a profiler, for two or more
source trees: what the context generator does between a request's arrival at the engine
and its first step's send, less the intake and the messages.

    python docs/lab/host_time/schedule_time.py --tree base=/tmp/base --tree branch=. \
        [--requests 3000] [--repeats 5] [--lengths 10,128]

Each tree runs in a child process with the tree on PYTHONPATH (the trees take turns, one
child at a time, the order turning each repeat). The child builds the tree's `Scheduler`
over a `BlockManager` of 2048 blocks of 16 tokens (max_batch 32, max_prefill_tokens 2048,
chunk_tokens 512 where the tree has it, max_model_len 2048), then, for each of `requests`
distinct random prompts (no prefix-cache hit), one at a time as the host-time probe sends
them (max_tokens 1): `add` (the sequence queued), `schedule` (admission, the prefix-cache
lookup, block keys, the step and its inputs: the part before the send) and `after` (the
deferred block keys registered where the tree defers them, the token landed, the sequence
freed, the scheduling that finds nothing left). Per request, µs: the median of the repeats
of each tree's mean over the requests after the first 200. Lab, not product.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time


def child(lengths: list[int], requests: int) -> dict[str, dict[str, float]]:
    from hybridd.engine.block_manager import BlockManager
    from hybridd.engine.scheduler import Scheduler
    from hybridd.engine.sequence import Sequence
    from hybridd.protocol.messages import SamplingParams

    out = {}
    for length in lengths:
        bm = BlockManager(2048, 16)
        kw = dict(max_batch=32, max_prefill_tokens=2048, max_model_len=2048)
        try:
            sched = Scheduler(bm, chunk_tokens=512, **kw)
        except TypeError:  # a tree before chunked prefill
            sched = Scheduler(bm, **kw)
        rng = random.Random(length)
        prompts = [[rng.randrange(1000) for _ in range(length)] for _ in range(requests)]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        register_deferred = getattr(bm, "register_deferred", lambda: None)
        totals = {"add": 0.0, "schedule": 0.0, "after": 0.0}
        gc.disable()
        for i, prompt in enumerate(prompts):
            seq = Sequence(f"r{i}", prompt, params)
            t0 = time.perf_counter()
            sched.add(seq)
            t1 = time.perf_counter()
            batch = sched.schedule()
            t2 = time.perf_counter()
            register_deferred()  # the engine core's, right after the step's send
            sched.postprocess(batch, [1])
            while sched.has_work and sched.schedule() is not None:
                pass
            sched.schedule()
            t3 = time.perf_counter()
            if i >= 200:
                totals["add"] += t1 - t0
                totals["schedule"] += t2 - t1
                totals["after"] += t3 - t2
        gc.enable()
        out[str(length)] = {k: v / (requests - 200) * 1e6 for k, v in totals.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", default="10,128")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        print(json.dumps(child(lengths, args.requests)))
        return
    specs = [tuple(spec.split("=", 1)) for spec in args.tree]
    runs: dict[str, list[dict]] = {name: [] for name, _ in specs}
    for repeat in range(args.repeats):
        for name, path in specs if repeat % 2 == 0 else specs[::-1]:
            result = subprocess.run(
                [sys.executable, __file__, "--child", "--requests", str(args.requests), "--lengths", args.lengths],
                env=dict(os.environ, PYTHONPATH=os.path.abspath(path)), capture_output=True, text=True, check=True)
            runs[name].append(json.loads(result.stdout))
    print("µs per request (median of the repeats)")
    for length in map(str, lengths):
        for part in ("add", "schedule", "after"):
            cells = [f"{name} {statistics.median(r[length][part] for r in runs[name]):6.1f}" for name, _ in specs]
            print(f"{length:>4} tokens {part:9s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
