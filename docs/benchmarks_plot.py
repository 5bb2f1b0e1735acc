"""Plot the results of scripts/bench.py: TTFT against prompt length, ITL p50 against concurrency.

    python docs/benchmarks_plot.py OUT/bench.json [--png docs/benchmarks.png] [--theirs paper.json]

Runs where matplotlib is installed (a dev tool, not a runtime dependency of hybridd);
the GPU machine only has to produce bench.json. Left panel: median TTFT at the client
for hybridd, hybridd with graphs off, HF eager and HF static+compile, with the prefill
floor. Right panel: hybridd's ITL p50 (and p99, dashed) at 1/4/16/32 streams, the
peers' batch-1 ITL p50 as single points, and the decode floor.

Published figures of others may stand beside ours only labelled as theirs: `--theirs`
takes a JSON file `{"label": "...", "source": "...", "ttft_ms": {"10": 12.3, ...}}`
(nothing is built in: no number here is invented).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SERIES = (("hybridd", "hybridd", "C0", "o"), ("hybridd_eager", "hybridd, graphs off", "C1", "s"),
          ("hf_eager", "HF generate eager", "C2", "^"), ("hf_static", "HF generate static+compile", "C3", "v"))


def plot(results: dict, png: Path, theirs: dict | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    meta = results.get("meta", {})
    floors = results.get("floors", {})

    for key, label, color, marker in SERIES:
        ttft = (results.get(key) or {}).get("ttft_s") or {}
        points = sorted((int(n), v["median_s"] * 1e3) for n, v in ttft.items() if v.get("median_s") is not None)
        if points:
            left.plot(*zip(*points), marker=marker, color=color, label=label)
    prefill = floors.get("prefill_floor_s") or {}
    if prefill:
        points = sorted((int(n), v * 1e3) for n, v in prefill.items())
        left.plot(*zip(*points), color="k", linestyle=":", label="prefill floor")
    if theirs and theirs.get("ttft_ms"):
        points = sorted((int(n), float(v)) for n, v in theirs["ttft_ms"].items())
        left.plot(*zip(*points), color="grey", marker="x", linestyle="--",
                  label=f"{theirs.get('label', 'published')} (theirs, not measured here)")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("TTFT at the client, median (ms)")
    left.set_title("Time to first token, batch 1")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    conc = (results.get("hybridd") or {}).get("concurrency") or {}
    if conc:
        levels = sorted(int(n) for n in conc)
        right.plot(levels, [conc[str(n)]["itl_p50_s"] * 1e3 for n in levels], marker="o", color="C0",
                   label="hybridd ITL p50")
        right.plot(levels, [conc[str(n)]["itl_p99_s"] * 1e3 for n in levels], marker="o", color="C0",
                   linestyle="--", alpha=0.6, label="hybridd ITL p99")
    for key, label, color, marker in SERIES[1:]:
        p50 = ((results.get(key) or {}).get("itl") or {}).get("p50_s")
        if p50 is not None:
            right.plot([1], [p50 * 1e3], marker=marker, color=color, linestyle="none", label=f"{label} (batch 1)")
    if floors.get("decode_floor_s"):
        right.axhline(floors["decode_floor_s"] * 1e3, color="k", linestyle=":", label="decode floor")
    right.set_xscale("log", base=2)
    if conc:
        right.set_xticks(levels, [str(n) for n in levels])
    right.set_yscale("log")
    right.set_xlabel("concurrent streams")
    right.set_ylabel("inter-token latency (ms)")
    right.set_title("ITL against concurrency")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)

    device = (results.get("device") or {}).get("name", "?")
    fig.suptitle(f"hybridd vs peers - {device} - {Path(str(meta.get('model', '?'))).name} - {meta.get('date', '')}",
                 fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="bench.json written by scripts/bench.py")
    parser.add_argument("--png", type=Path, help="output image (default: next to the JSON, bench.png)")
    parser.add_argument("--theirs", type=Path, help="published TTFT figures of others, labelled as theirs")
    args = parser.parse_args(argv)
    results = json.loads(args.json.read_text())
    theirs = json.loads(args.theirs.read_text()) if args.theirs else None
    print(plot(results, args.png or args.json.with_name("bench.png"), theirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
