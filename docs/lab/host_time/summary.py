"""The notebook's figures from a `measure.py --out` file: each tree's CPU µs per request
(median of the repeats, each repeat), and each pair of trees' difference taken within a
repeat (the trees' requests interleaved, so a repeat's load is the same for all of them).

    python docs/lab/host_time/summary.py host_time.json [--base base]

Lab, not product.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    args = parser.parse_args()
    runs = json.load(open(args.file))
    names = list(dict.fromkeys(r["tree"] for r in runs))
    repeats = sorted({r["repeat"] for r in runs})
    by = {(r["tree"], r["repeat"]): r for r in runs}
    lengths = list(runs[0]["lengths"])

    def value(tree: str, repeat: int, length: str, process: str) -> float:
        return by[(tree, repeat)]["lengths"][length]["cpu_us_per_request"][process]["process"]

    print("idle CPU ms per 10 s:", {n: {t: [round(by[(n, k)]["idle_cpu_ms"][t] * 10 / by[(n, k)]["idle_s"], 1)
                                            for k in repeats] for t in by[(n, 0)]["idle_cpu_ms"]} for n in names})
    for length in lengths:
        for process in ("context-generator", "graph-generator", "supervisor"):
            cells = []
            for name in names:
                values = [value(name, k, length, process) for k in repeats]
                cells.append(f"{name} {statistics.median(values):.0f} [{', '.join(f'{v:.0f}' for v in values)}]")
            for a, b in itertools.combinations(names, 2):
                deltas = [value(b, k, length, process) - value(a, k, length, process) for k in repeats]
                cells.append(f"{b}-{a} {statistics.median(deltas):+.0f} [{', '.join(f'{d:+.0f}' for d in deltas)}]")
            print(f"{length:>4} tokens {process:18s} " + "; ".join(cells))


if __name__ == "__main__":
    main()
