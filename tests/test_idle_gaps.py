"""The idle-gap analysis of merged worker traces, on synthetic chrome traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_trace(path: Path, base_ns: int, kernels: list[tuple[float, float]]) -> None:
    events = [{"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur} for ts, dur in kernels]
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": events}))


def test_gaps_are_measured_across_both_processes(tmp_path):
    # Graph generator: 100 µs kernels every 150 µs; the context generator fills 40 µs of
    # each 50 µs hole, from a trace with another base time, leaving 10 µs gaps.
    graph = [(i * 150.0, 100.0) for i in range(10)]
    context = [(i * 150.0 + 100.0 - 50.0, 40.0) for i in range(10)]  # its base is 50 µs later
    write_trace(tmp_path / "trace-graph-1.json", 1_000_000, graph)
    write_trace(tmp_path / "trace-context-2.json", 1_050_000, context)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_idle_gaps.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["gap_max_us"] == 10.0 and result["gaps_over_50us"] == 0
    assert abs(result["busy_fraction"] - 140 / 150) < 0.02


def test_long_gaps_are_named_by_the_kernels_around_them(tmp_path):
    # Each 200 µs period: graph "replay" 0-100, context "sample" 130-150 (30 µs gap before
    # it), then 50 µs idle until the next replay.
    graph = [(i * 200.0, 100.0) for i in range(5)]
    context = [(i * 200.0 + 130.0, 20.0) for i in range(5)]
    write_trace(tmp_path / "trace-graph-1.json", 0, graph)
    events = [{"ph": "X", "cat": "kernel", "name": "sample", "ts": ts, "dur": dur} for ts, dur in context]
    (tmp_path / "trace-context-2.json").write_text(json.dumps({"baseTimeNanoseconds": 0, "traceEvents": events}))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_idle_gaps.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True)
    sources = json.loads(out.stdout)["largest_sources_over_20us"]
    assert sources[0] == {"before": "context:sample", "after": "graph:k", "count": 4, "total_us": 200.0,
                          "median_us": 50.0}
    assert sources[1]["before"] == "graph:k" and sources[1]["after"] == "context:sample"
    # The window both traces cover is 130-900 µs: three of those gaps fall inside it.
    assert sources[1]["count"] == 3 and sources[1]["median_us"] == 30.0
