"""The functions whose CPU time per request grew the most between two trees, from the
cProfile files `measure.py --profile DIR` writes (DIR/<tree>-<repeat>-<worker>-<length>.prof).

    python docs/lab/host_time/profile_table.py DIR --a base --b main --worker context-generator \
        --length 10 --requests 200 [--top 30] [--sort cum|self]

Functions are matched by file (from the tree's root) and name, not line. Times are the
main thread's CPU (the profiler's clock), summed over the repeats found, per request.
Lab, not product.
"""

from __future__ import annotations

import argparse
import pstats
import re
from collections import defaultdict
from pathlib import Path


def where(path: str) -> str:
    for marker in ("site-packages/", "lib/python3.11/"):
        if marker in path:
            return path.split(marker, 1)[1]
    match = re.search(r"/((?:hybridd|workers|ipc|protocol)/.*)$", path)
    return match.group(1) if match else path


def load(files: list[Path]) -> tuple[dict[tuple[str, str], list[float]], int]:
    """(file, function) -> [self s, cumulative s, calls], summed over the files."""
    out: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for file in files:
        stats = pstats.Stats(str(file)).stats
        for (path, _line, name), (_cc, calls, self_s, cum_s, _callers) in stats.items():
            key = (where(path), name)
            entry = out[key]
            entry[0] += self_s
            # recursion and same-named functions: a cumulative time counts once per key
            entry[1] = max(entry[1], cum_s) if len(files) == 1 else entry[1] + cum_s
            entry[2] += calls
    return out, len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--worker", default="context-generator")
    parser.add_argument("--length", default="10")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", choices=("cum", "self"), default="cum")
    parser.add_argument("--match", default=None, help="only functions whose file or name contains this")
    args = parser.parse_args()
    column = 1 if args.sort == "cum" else 0
    tables = {}
    for tree in (args.a, args.b):
        files = sorted(Path(args.dir).glob(f"{tree}-*-{args.worker}-{args.length}.prof"))
        if not files:
            raise SystemExit(f"no profile for {tree}")
        tables[tree] = load(files)
    per = {tree: {k: [v[0] / n / args.requests * 1e6, v[1] / n / args.requests * 1e6, v[2] / n / args.requests]
                  for k, v in table.items()} for tree, (table, n) in tables.items()}
    a, b = per[args.a], per[args.b]
    total = {tree: sum(v[0] for v in per[tree].values()) for tree in per}
    print(f"{args.worker}, {args.length} tokens: profiled CPU µs per request (sum of self): "
          f"{args.a} {total[args.a]:.0f}, {args.b} {total[args.b]:.0f}")
    keys = set(a) | set(b)
    if args.match:
        keys = {k for k in keys if args.match in k[0] or args.match in k[1]}
    rows = sorted(keys, key=lambda k: -abs(b.get(k, [0, 0, 0])[column] - a.get(k, [0, 0, 0])[column]))
    print(f"{'µs/req ' + args.sort:>14s} {args.a:>8s} {args.b:>8s} {'delta':>8s} {'calls/req':>14s}  function")
    for k in rows[:args.top]:
        va, vb = a.get(k, [0, 0, 0]), b.get(k, [0, 0, 0])
        print(f"{'':14s} {va[column]:8.1f} {vb[column]:8.1f} {vb[column] - va[column]:+8.1f} "
              f"{va[2]:6.1f}/{vb[2]:<6.1f}  {k[1]} ({k[0]})")


if __name__ == "__main__":
    main()
