"""Merge the step traces of both workers (see hybridd/runtime/step_trace.py) and measure
the GPU's idle time between kernels, whichever process launched them.

    python scripts/gpu_idle_gaps.py TRACE_DIR

Prints the busy fraction over the traced window and the idle gaps' p50/p99/max; a
steady-state decode loop with no idle gap between steps shows gaps of a few
microseconds (kernel boundaries) and no gap of the order of a step. Gaps longer than
`ATTRIBUTE_US` are attributed to the kernels on either side of them (which worker,
which kernel), so that the largest sources of idle time are named.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


ATTRIBUTE_US = 20.0


def kernel_intervals(path: Path, name_chars: int | None = 60) -> list[tuple[float, float, str]]:
    """(start µs, end µs, "worker:kernel") of every kernel, copy and memset in a trace
    (kernel names cut to `name_chars` characters; None keeps them whole)."""
    trace = json.loads(path.read_text())
    base_us = trace.get("baseTimeNanoseconds", 0) / 1000.0
    worker = path.stem.split("-")[1] if path.stem.count("-") >= 2 else path.stem
    out = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            start = base_us + float(event["ts"])
            out.append((start, start + float(event.get("dur", 0)), f"{worker}:{str(event.get('name', '?'))[:name_chars]}"))
    return out


def idle_gaps(intervals: list[tuple[float, float, str]]) -> tuple[list[tuple[float, str, str]], float, float]:
    """Gaps between the union of busy intervals, each as (µs, kernel before, kernel after);
    also the window and the busy time."""
    intervals.sort()
    gaps, busy = [], 0.0
    cur_start, cur_end, last = intervals[0]
    for start, end, name in intervals[1:]:
        if start > cur_end:
            gaps.append((start - cur_end, last, name))
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end < cur_end:
            continue
        cur_end, last = end, name
    busy += cur_end - cur_start
    return gaps, intervals[-1][1] - intervals[0][0], busy


def attribute(gaps: list[tuple[float, str, str]], top: int = 8) -> list[dict]:
    """The largest sources of idle time: gaps over ATTRIBUTE_US grouped by the kernels around them."""
    groups: dict[tuple[str, str], list[float]] = {}
    for gap, before, after in gaps:
        if gap > ATTRIBUTE_US:
            groups.setdefault((before, after), []).append(gap)
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"before": b, "after": a, "count": len(v), "total_us": round(sum(v), 1),
             "median_us": round(sorted(v)[len(v) // 2], 1)} for (b, a), v in ranked]


def main() -> int:
    directory = Path(sys.argv[1])
    traces = sorted(directory.glob("trace-*.json"))
    if len(traces) < 2:
        print(f"expected a trace from each worker in {directory}, found {len(traces)}", file=sys.stderr)
        return 1
    per_trace = {p.name: kernel_intervals(p) for p in traces}
    # Only the window that every trace covers: both processes were being profiled.
    lo = max(min(s for s, _, _ in iv) for iv in per_trace.values())
    hi = min(max(e for _, e, _ in iv) for iv in per_trace.values())
    merged = [(max(s, lo), min(e, hi), n) for iv in per_trace.values() for s, e, n in iv if e > lo and s < hi]
    named_gaps, window, busy = idle_gaps(merged)
    gaps = sorted(g for g, _, _ in named_gaps)
    result = {
        "traces": {name: len(iv) for name, iv in per_trace.items()},
        "window_ms": window / 1e3,
        "busy_fraction": busy / window,
        "gap_p50_us": gaps[len(gaps) // 2] if gaps else 0.0,
        "gap_p99_us": gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "gap_max_us": gaps[-1] if gaps else 0.0,
        "gaps_over_50us": sum(g > 50 for g in gaps),
        "idle_us_total": round(sum(gaps), 1),
        f"largest_sources_over_{ATTRIBUTE_US:g}us": attribute(named_gaps),
    }
    print(json.dumps(result, indent=2))
    (directory / "idle_gaps.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
