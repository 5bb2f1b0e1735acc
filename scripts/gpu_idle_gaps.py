"""Merge the step traces of both workers (see hybridd/runtime/step_trace.py) and measure
the GPU's idle time between kernels, whichever process launched them.

    python scripts/gpu_idle_gaps.py TRACE_DIR

Prints the busy fraction over the traced window and the idle gaps' p50/p99/max; a
steady-state decode loop with no idle gap between steps shows gaps of a few
microseconds (kernel boundaries) and no gap of the order of a step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def kernel_intervals(path: Path) -> list[tuple[float, float]]:
    trace = json.loads(path.read_text())
    base_us = trace.get("baseTimeNanoseconds", 0) / 1000.0
    out = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            start = base_us + float(event["ts"])
            out.append((start, start + float(event.get("dur", 0))))
    return out


def idle_gaps(intervals: list[tuple[float, float]]) -> tuple[list[float], float, float]:
    """Gaps (µs) between the union of busy intervals; also the window and busy time."""
    intervals.sort()
    gaps, busy = [], 0.0
    cur_start, cur_end = intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            gaps.append(start - cur_end)
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return gaps, intervals[-1][1] - intervals[0][0], busy


def main() -> int:
    directory = Path(sys.argv[1])
    traces = sorted(directory.glob("trace-*.json"))
    if len(traces) < 2:
        print(f"expected a trace from each worker in {directory}, found {len(traces)}", file=sys.stderr)
        return 1
    per_trace = {p.name: kernel_intervals(p) for p in traces}
    # Only the window that every trace covers: both processes were being profiled.
    lo = max(min(s for s, _ in iv) for iv in per_trace.values())
    hi = min(max(e for _, e in iv) for iv in per_trace.values())
    merged = [(max(s, lo), min(e, hi)) for iv in per_trace.values() for s, e in iv if e > lo and s < hi]
    gaps, window, busy = idle_gaps(merged)
    gaps.sort()
    result = {
        "traces": {name: len(iv) for name, iv in per_trace.items()},
        "window_ms": window / 1e3,
        "busy_fraction": busy / window,
        "gap_p50_us": gaps[len(gaps) // 2] if gaps else 0.0,
        "gap_p99_us": gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "gap_max_us": gaps[-1] if gaps else 0.0,
        "gaps_over_50us": sum(g > 50 for g in gaps),
    }
    print(json.dumps(result, indent=2))
    (directory / "idle_gaps.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
