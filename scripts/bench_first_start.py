"""A daemon's first start on a host: the time from its weights loaded to ready with
Triton's and Inductor's caches empty, by how many processes compile the graphs'
kernels (`kernel_compile_workers`), and a later start that finds them cached.

    python scripts/bench_first_start.py --out $OUT --workers 0,8,16

Random weights of the preset's shape (as scripts/bench.py writes them); both workers
compile what the daemon's do at start (the graphs' kernels, the sampler's). Each start in
`--workers` gets caches of its own, empty; `--warm-again` (default on) starts once more
on the last start's caches. Prints one line per start and writes first_start.json with
each start's phases (seconds from spawn) as the graph generator reported them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

def phase_spans(phases: list[dict]) -> dict[str, float]:
    """Seconds between each worker's consecutive phase reports, by worker and the detail of
    the report that opened each span (a worker's last span ends at its ready)."""
    spans: dict[str, float] = {}
    for worker in ("graph", "context"):
        own = [p for p in phases if p["worker"] == worker]
        for p, after in zip(own, own[1:]):
            label = f"{worker}: {p['detail'] or p['phase']}"
            spans[label] = round(spans.get(label, 0.0) + after["t_s"] - p["t_s"], 3)
    return spans


def one_start(model: Path, workers: int, caches: Path, timeout_s: float) -> dict:
    from bench import HybriddServer, on_empty_compile_caches

    def start() -> dict:
        # The sampler's kernels too, as the daemon compiles them at start (the context generator's part).
        server = HybriddServer(model, "cuda", timeout_s, kernel_compile_workers=workers, compile_sampler=True)
        try:
            return server.startup()
        finally:
            server.close()

    startup = on_empty_compile_caches(start, caches)
    return {"kernel_compile_workers": workers, "caches": str(caches),
            "spawn_to_ready_s": startup["spawn_to_ready_s"], "after_weights_to_ready_s": startup["after_weights_to_ready_s"],
            "weights_load_s": startup["weights_load_s"],
            "compile_cache_files_at_spawn": startup["compile_cache_files_at_spawn"],
            "spans_s": phase_spans(startup["phases"]), "phases": startup["phases"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--workers", default="0,8", help="comma-separated kernel_compile_workers, one start each")
    p.add_argument("--warm-again", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout-s", type=float, default=300.0, help="the longest one start is waited for")
    args = p.parse_args()
    from bench import make_model

    args.out.mkdir(parents=True, exist_ok=True)
    args.device, args.checkpoint_dir = "cuda", None
    model = make_model(args)
    scratch = Path(tempfile.mkdtemp(prefix="hybridd-first-start-"))
    starts = []
    try:
        plan = [(int(w), scratch / f"caches-{i}") for i, w in enumerate(args.workers.split(","))]
        if args.warm_again:
            plan.append((plan[-1][0], plan[-1][1]))
        for workers, caches in plan:
            result = one_start(model, workers, caches, args.timeout_s)
            starts.append(result)
            files = result["compile_cache_files_at_spawn"]
            print(f"kernel_compile_workers {workers}: weights -> ready {result['after_weights_to_ready_s']:.1f} s "
                  f"(cache files at spawn: triton {files['triton']}, inductor {files['inductor']}); "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in result["spans_s"].items()), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        (args.out / "first_start.json").write_text(json.dumps(
            {"preset": args.preset, "cpu_count": os.cpu_count(), "starts": starts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
