"""Host time to build a prefill step's inputs (`HostStepInputs.prefill`), which every
first token waits for: this tree's, optionally against a git revision's.

    python scripts/bench_step_inputs.py                      # this tree
    python scripts/bench_step_inputs.py --baseline 1a2b3c4   # and step_inputs.py as it was there

Prompts of 10-500 tokens over blocks of 16 tokens in no order (as a block manager hands
them out), one prompt a step and four; block tables padded to 256 blocks as the scheduler
pads them. Both builds run in one process on the same prompts, and must give the same
arrays; µs per call, the best of five runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import timeit
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hybridd.model import step_inputs  # noqa: E402

BLOCK = 16
TABLE_WIDTH = 256
LENGTHS = (10, 32, 128, 256, 500)
FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices")


def load_baseline(revision: str):
    """`revision`'s hybridd/model/step_inputs.py as a module of its own."""
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:hybridd/model/step_inputs.py"],
                           capture_output=True, text=True)
    if shown.returncode:
        raise SystemExit(f"--baseline {revision}: {shown.stderr.strip()}")
    source = shown.stdout
    path = Path(tempfile.mkdtemp(prefix="hybridd-step-inputs-")) / "baseline_step_inputs.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_step_inputs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def per_call_us(function: Callable[[], Any]) -> float:
    timer = timeit.Timer(function)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def case(rng: random.Random, length: int, prompts: int) -> tuple[list[list[int]], list[list[int]]]:
    free = list(range(20000))
    rng.shuffle(free)
    ids = [[rng.randrange(32000) for _ in range(length)] for _ in range(prompts)]
    tables = [[free.pop() for _ in range(-(-length // BLOCK))] for _ in range(prompts)]
    return ids, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision whose step_inputs.py to compare against")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    rng = random.Random(5)
    rows = []
    header = f"{'tokens a prompt':>15} {'prompts':>8} {'this tree µs':>13}"
    if baseline:
        header += f" {'baseline µs':>12} {'speed-up':>9}"
    print(header)
    for prompts in (1, 4):
        for length in LENGTHS:
            ids, tables = case(rng, length, prompts)
            build = partial(step_inputs.HostStepInputs.prefill, ids, tables, BLOCK, table_width=TABLE_WIDTH)
            row = {"tokens": length, "prompts": prompts, "us": round(per_call_us(build), 2)}
            line = f"{length:>15} {prompts:>8} {row['us']:>13.2f}"
            if baseline:
                old = partial(baseline.HostStepInputs.prefill, ids, tables, BLOCK, table_width=TABLE_WIDTH)
                new_step, old_step = build(), old()
                for name in FIELDS:
                    a, b = getattr(new_step, name), getattr(old_step, name)
                    if a.dtype != b.dtype or not np.array_equal(a, b):
                        raise SystemExit(f"{name} differs from the baseline's for {prompts} prompts of {length} tokens")
                row["baseline_us"] = round(per_call_us(old), 2)
                line += f" {row['baseline_us']:>12.2f} {row['baseline_us'] / row['us']:>8.2f}x"
            rows.append(row)
            print(line)
    if args.out:
        args.out.write_text(json.dumps({"baseline": args.baseline, "block_size": BLOCK, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
