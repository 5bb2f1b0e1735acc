"""How much slower the context generator's Python runs right after its process wakes:
one prefill's scheduling (`Scheduler.schedule`, with the inputs' build a first token
waits for), timed back to back and after the process has slept.

    python scripts/bench_wakeup.py [--prompt-len 128] [--idle-ms 1,5,20] [--out FILE]

Between requests a worker sleeps in its poller; the request's first step then runs on
a core that was idle, its caches and branch predictors holding other work's state (and,
on a virtual machine, possibly on another physical core). Each round queues one prompt
of `--prompt-len` tokens, sleeps the round's idle time, and times `schedule()`; the
sequence is then dropped, so every round schedules the same work. The back-to-back
case is timed first and again last, the run's control. µs per call, median and p90 of
`--rounds` rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hybridd import log  # noqa: E402
from hybridd.engine.block_manager import BlockManager  # noqa: E402
from hybridd.engine.scheduler import Scheduler  # noqa: E402
from hybridd.engine.sequence import Sequence  # noqa: E402
from hybridd.protocol.messages import SamplingParams  # noqa: E402
from hybridd.stats import percentiles  # noqa: E402

BLOCK = 16
MAX_MODEL_LEN = 4096


def scheduler() -> Scheduler:
    """The daemon's default geometry: blocks of 16 tokens, 4,096-token sequences."""
    return Scheduler(BlockManager(8192, BLOCK), max_batch=32, max_prefill_tokens=2048, max_model_len=MAX_MODEL_LEN)


def schedule_times(sched: Scheduler, prompt_len: int, idle_s: float, rounds: int) -> list[float]:
    """Seconds per `schedule()` of one queued prompt, each after `idle_s` asleep."""
    times = []
    params = SamplingParams(max_tokens=1)
    for i in range(rounds):
        seq = Sequence(f"r{i}", list(range(prompt_len)), params)
        sched.add(seq)
        if idle_s:
            time.sleep(idle_s)
        start = time.perf_counter()
        batch = sched.schedule()
        times.append(time.perf_counter() - start)
        if batch is None or batch.num_tokens != prompt_len:
            raise SystemExit(f"round {i}: the prompt of {prompt_len} tokens was not scheduled alone")
        sched.abort(seq.request_id)
    return times


def idle_milliseconds(value: str) -> list[float]:
    """An `--idle-ms` value: a comma list of sleeps in milliseconds, one or more, none negative."""
    try:
        idles = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma list of milliseconds") from None
    if not idles or min(idles) < 0:
        raise argparse.ArgumentTypeError("needs one sleep or more, none negative")
    return idles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--idle-ms", type=idle_milliseconds, default="1,5,20",
                        help="comma list of sleeps before each call, besides none")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()
    if not 0 < args.prompt_len < MAX_MODEL_LEN:
        parser.error(f"--prompt-len must be 1-{MAX_MODEL_LEN - 1}")
    log.configure(level="warning")  # the rounds' aborts log at info
    sched = scheduler()
    schedule_times(sched, args.prompt_len, 0.0, 50)  # warm-up
    rows = []
    print(f"{args.prompt_len}-token prompt, {args.rounds} rounds; µs per schedule()")
    print(f"{'asleep before':>14} {'median':>8} {'p90':>8}")
    for idle_ms in [0.0, *args.idle_ms, 0.0]:
        median, p90 = percentiles(schedule_times(sched, args.prompt_len, idle_ms / 1e3, args.rounds), 50, 90)
        row = {"idle_ms": idle_ms, "median_us": round(median * 1e6, 1), "p90_us": round(p90 * 1e6, 1)}
        rows.append(row)
        print(f"{idle_ms:>11.1f} ms {row['median_us']:>8.1f} {row['p90_us']:>8.1f}")
    if args.out:
        args.out.write_text(json.dumps({"prompt_len": args.prompt_len, "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
