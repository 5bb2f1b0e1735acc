"""The context generator's work before a new request's first step is sent, per tree, from
the cProfile files `measure.py --profile DIR` writes (DIR/<tree>-<repeat>-<worker>-<length>.prof).

    python docs/lab/host_time/presend.py DIR --trees base,main,branch [--requests 200]

A request's path to its step's send is: the intake (the client's frame read, the request
decoded and handed to the engine core), the scheduling (admission, the prefix-cache
lookup, the step's inputs), the step's inputs written to the step buffers, the messages
to the graph generator (the `Expect` at intake, the `Step`). Each row is a function's
cumulative profiled µs per request (its calls per request in brackets), matched by
file and name, with the older tree's name where a function was renamed; the total is
the sum of the rows that do not nest. Profiled times are inflated, most where calls are
many and short: compare trees, not with unprofiled figures. Lab, not product.
"""

from __future__ import annotations

import argparse
import pstats
from pathlib import Path

# (label, [(file suffix, function name), ...] alternatives across trees, counted in the total)
ROWS = [
    ("intake (the request read to the core's add)", [("workers/client_messages.py", "read"),
                                                     ("workers/context_generator.py", "_client_messages")], True),
    ("Scheduler.schedule", [("hybridd/engine/scheduler.py", "schedule")], True),
    ("  of which the prompt chunks and admission", [("hybridd/engine/scheduler.py", "_prefill_chunks")], False),
    ("    of which the prefix-cache lookup", [("hybridd/engine/block_manager.py", "cached_prefix")], False),
    ("    of which the blocks", [("hybridd/engine/block_manager.py", "allocate")], False),
    ("  of which the step (its rows and inputs)", [("hybridd/engine/scheduler.py", "_mixed_batch"),
                                                   ("hybridd/engine/scheduler.py", "_schedule_prefill")], False),
    ("    of which HostStepInputs.prefill", [("hybridd/model/step_inputs.py", "prefill")], False),
    ("    of which the blocks offered the cache", [("hybridd/engine/block_manager.py", "cache_blocks"),
                                                   ("hybridd/engine/block_manager.py", "defer_cache_blocks")], False),
    ("the step's inputs to the step buffers", [("hybridd/runtime/step_buffers.py", "write")], True),
    ("messages to the graph generator", [("ipc/channel.py", "send")], True),
    ("after the send: deferred block keys registered", [("hybridd/engine/block_manager.py", "register_deferred")],
     False),
]


# Called from elsewhere too: only their calls from the scheduler count (the blocks a freed
# sequence offers the cache are offered after the send).
FROM_SCHEDULER = {("hybridd/engine/block_manager.py", "cache_blocks"),
                  ("hybridd/engine/block_manager.py", "defer_cache_blocks")}


def load(files: list[Path]) -> dict[tuple[str, str], tuple[float, float]]:
    """(file, function) -> (cumulative s, calls), summed over the files."""
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for file in files:
        for (path, _line, name), (_cc, calls, _self, cum, callers) in pstats.Stats(str(file)).stats.items():
            for suffixes in ROWS:
                for suffix, function in suffixes[1]:
                    if name != function or not path.endswith(suffix):
                        continue
                    if (suffix, function) in FROM_SCHEDULER:
                        by = [v for (p, _l, _n), v in callers.items() if p.endswith("hybridd/engine/scheduler.py")]
                        calls, cum = sum(v[1] for v in by), sum(v[3] for v in by)
                    cum0, calls0 = out.get((suffix, function), (0.0, 0.0))
                    out[(suffix, function)] = (cum0 + cum, calls0 + calls)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--trees", required=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--worker", default="context-generator")
    args = parser.parse_args()
    trees = args.trees.split(",")
    lengths = sorted({p.stem.rsplit("-", 1)[1] for p in Path(args.dir).glob(f"*-{args.worker}-*.prof")}, key=int)
    for length in lengths:
        tables = {}
        for tree in trees:
            files = sorted(Path(args.dir).glob(f"{tree}-*-{args.worker}-{length}.prof"))
            if not files:
                raise SystemExit(f"no profile for {tree} at {length} tokens")
            per = len(files) * args.requests
            tables[tree] = {k: (cum * 1e6 / per, calls / per) for k, (cum, calls) in load(files).items()}
        print(f"\n{args.worker}, {length} tokens: profiled µs per request (calls per request)")
        print(f"{'':48s}" + "".join(f"{tree:>16s}" for tree in trees))
        totals = dict.fromkeys(trees, 0.0)
        for label, alternatives, counted in ROWS:
            cells = []
            for tree in trees:
                found = [tables[tree][alt] for alt in alternatives if alt in tables[tree]]
                us, calls = (sum(f[0] for f in found), sum(f[1] for f in found)) if found else (0.0, 0.0)
                totals[tree] += us if counted else 0.0
                cells.append(f"{us:9.0f} ({calls:3.1f})")
            print(f"{label:48s}" + "".join(f"{c:>16s}" for c in cells))
        print(f"{'before the send, in all':48s}" + "".join(f"{totals[tree]:16.0f}" for tree in trees))


if __name__ == "__main__":
    main()
