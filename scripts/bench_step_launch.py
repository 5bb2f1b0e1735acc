"""A step's launch on the graph generator's side, from an idle host and GPU (CUDA).

    python scripts/bench_step_launch.py --out $OUT/step_launch.json [--idle-ms 1,5,20]

Two parts, each printed as a table and written to `--out`:

1. **`GraphRunner.run`** of a 128-token prefill and of a batch-1 decode step at context
   512 (the random Llama-2-7B shape, or `--model DIR`), timed on the host from the call
   to its return, each after the serving stream has drained and the thread has slept
   the round's idle time. Rounds alternate between the thread bound to the serving
   stream (`GraphRunner.serve_from_this_thread`, as the graph generator's serving thread
   is) and the same thread switching to it per step (`torch.cuda.stream`), as every
   step once did.
2. **Bare CUDA graphs** of `--kernels` kernels (one stamp kernel, elementwise kernels,
   one stamp kernel), each launched after the GPU has idled 10 ms: when the launch call
   returns, and when the GPU starts the first kernel and ends the last, from the two
   stamps (`%globaltimer`) put on the host's clock. The offset between the clocks is
   bounded by one-kernel round trips; the bound's width is printed, and each GPU time is
   good to about half of it. Each graph runs whole and split in two (its first 8 kernels,
   then the rest): whether the GPU waits for a long graph's launch to end before it
   starts, which a split would shorten.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_wakeup import idle_milliseconds  # noqa: E402

from hybridd.stats import percentiles  # noqa: E402

CONTEXT = 512
PREFILL_TOKENS = 128
SPLIT_HEAD = 8
GPU_IDLE_S = 0.010


def _kernel_counts(value: str) -> list[int]:
    try:
        counts = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma list of kernel counts") from None
    if not counts or min(counts) <= SPLIT_HEAD + 1:
        raise argparse.ArgumentTypeError(f"each graph needs more than {SPLIT_HEAD + 1} kernels (its split keeps {SPLIT_HEAD} apart)")
    return counts


def _median_us(samples_ns: list[int]) -> float:
    return round(percentiles(samples_ns, 50)[0] / 1e3, 1)


def runner_launches(model_dir: Path | None, idles_ms: list[float], rounds: int) -> list[dict]:
    """Part 1: µs per `GraphRunner.run` from idle, bound and switching, per step and idle time."""
    import torch
    from bench_graphs import captured_runner, decode_step, prefill_step, stepper
    from make_random_checkpoint import make_checkpoint

    from hybridd.model import load_model

    if model_dir is None:
        model_dir = make_checkpoint(Path("/tmp/hybridd-llama2-7b-normal-random"), "llama2-7b")
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda", max_positions=2048)
    width = (CONTEXT + PREFILL_TOKENS) // 16 + 1
    runner = captured_runner(model, [1], [PREFILL_TOKENS], width, timeout_s=300)
    table = list(range(width))
    steps = {f"prefill, {PREFILL_TOKENS} tokens": prefill_step(PREFILL_TOKENS, table),
             f"decode, batch 1, context {CONTEXT}": decode_step(1, CONTEXT, [table])}
    runner.serve_from_this_thread()
    this_thread = threading.get_ident()
    rows = []
    for name, step in steps.items():
        run = stepper(runner, step)
        for _ in range(20):
            run()
        for idle_ms in [0.0, *idles_ms]:
            samples: dict[str, list[int]] = {"bound": [], "switching": []}
            for i in range(2 * rounds):
                mode = "bound" if i % 2 else "switching"
                runner.serving.thread = this_thread if mode == "bound" else None
                runner.stream.synchronize()
                if idle_ms:
                    time.sleep(idle_ms / 1e3)
                start = time.perf_counter_ns()
                shape = run()
                samples[mode].append(time.perf_counter_ns() - start)
                if not shape.graph:
                    raise SystemExit(f"{name} did not replay a graph")
            runner.serving.thread = this_thread
            runner.stream.synchronize()
            rows.append({"step": name, "idle_ms": idle_ms,
                         **{f"{mode}_us": _median_us(s) for mode, s in samples.items()}})
    return rows


def graph_launches(kernel_counts: list[int], rounds: int) -> dict:
    """Part 2: bare graphs' launch return and GPU start and end, µs after the launch call."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def stamp(out_ptr, index):
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
        tl.store(out_ptr + index, now)

    stamps = torch.zeros(8, dtype=torch.int64, device="cuda")
    work = torch.ones(1 << 20, device="cuda")

    def clock_offset() -> tuple[int, int]:
        """Bounds of (GPU clock - host clock) in ns, from one-kernel round trips."""
        low, high = -(1 << 62), 1 << 62
        for _ in range(200):
            torch.cuda.synchronize()
            time.sleep(0.001)
            before = time.perf_counter_ns()
            stamp[(1,)](stamps, 7)
            torch.cuda.synchronize()
            after = time.perf_counter_ns()
            gpu = int(stamps[7].item())
            low, high = max(low, gpu - after), min(high, gpu - before)
        return low, high

    def capture(body, pool=None):
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
            torch.cuda.synchronize()
            graph.capture_begin(pool=pool)
            body()
            graph.capture_end()
        torch.cuda.synchronize()
        return graph

    def kernels(first: bool, n: int, last: bool):
        def body():
            if first:
                stamp[(1,)](stamps, 0)
            for _ in range(n):
                work.mul_(1.0000001)
            if last:
                stamp[(1,)](stamps, 1)
        return body

    low, high = clock_offset()
    offset = (low + high) // 2
    rows = []
    for count in kernel_counts:
        whole = capture(kernels(True, count - 2, True))
        head = capture(kernels(True, SPLIT_HEAD - 1, False), whole.pool())
        tail = capture(kernels(False, count - SPLIT_HEAD - 1, True), whole.pool())
        for form, graphs in (("whole", [whole]), (f"{SPLIT_HEAD} + {count - SPLIT_HEAD}", [head, tail])):
            times: dict[str, list[int]] = {"launch_returned": [], "first_kernel_started": [], "last_kernel_ended": []}
            for i in range(rounds + 5):
                torch.cuda.synchronize()
                time.sleep(GPU_IDLE_S)
                start = time.perf_counter_ns()
                for graph in graphs:
                    graph.replay()
                returned = time.perf_counter_ns()
                torch.cuda.synchronize()
                first, last = (int(v) for v in stamps[:2].tolist())
                if i >= 5:
                    times["launch_returned"].append(returned - start)
                    times["first_kernel_started"].append(first - offset - start)
                    times["last_kernel_ended"].append(last - offset - start)
            rows.append({"kernels": count, "graphs": form, **{f"{k}_us": _median_us(v) for k, v in times.items()}})
    drift_low, drift_high = clock_offset()
    return {"clock_bound_width_us": round((high - low) / 1e3, 1),
            "clock_drift_us": round(((drift_low + drift_high) // 2 - offset) / 1e3, 1), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the figures")
    parser.add_argument("--model", type=Path, help="local HF model directory (default: random Llama-2-7B shape)")
    parser.add_argument("--idle-ms", type=idle_milliseconds, default="1,5,20",
                        help="comma list of host sleeps before each step, besides none (default 1,5,20)")
    parser.add_argument("--kernels", type=_kernel_counts, default=[16, 100, 230, 460],
                        help="comma list of bare graphs' kernel counts (default 16,100,230,460)")
    parser.add_argument("--rounds", type=int, default=60, help="timed launches per cell (default 60)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_step_launch.py needs a CUDA device")
    from hybridd import log

    log.configure(level="warning")
    steps = runner_launches(args.model, args.idle_ms, args.rounds)
    bare = graph_launches(args.kernels, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "steps": steps, "bare_graphs": bare}, indent=1))
    print(f"{torch.cuda.get_device_name()}: GraphRunner.run, µs from the call to its return (median)")
    print(f"{'step':32s} {'asleep before':>13s} {'switching':>10s} {'bound':>8s}")
    for row in steps:
        print(f"{row['step']:32s} {row['idle_ms']:10.1f} ms {row['switching_us']:10.1f} {row['bound_us']:8.1f}")
    print(f"bare graphs after {GPU_IDLE_S * 1e3:g} ms idle, µs after the launch call (median; clock bound "
          f"{bare['clock_bound_width_us']} µs wide, drift {bare['clock_drift_us']} µs)")
    print(f"{'kernels':>8s} {'graphs':>10s} {'returned':>9s} {'GPU starts':>11s} {'GPU ends':>9s}")
    for row in bare["rows"]:
        print(f"{row['kernels']:8d} {row['graphs']:>10s} {row['launch_returned_us']:9.1f} "
              f"{row['first_kernel_started_us']:11.1f} {row['last_kernel_ended_us']:9.1f}")


if __name__ == "__main__":
    main()
