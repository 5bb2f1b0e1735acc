"""Host CPU time per request, per daemon process, for two or more source trees at once.

Each tree (a checkout of hybridd: its package, its workers, its SDK) gets its own
daemon, `hybridd start` with its defaults (the embedded model, a fresh runtime
directory), started by a child process that has the tree on PYTHONPATH and sends that
daemon's requests with the tree's own SDK. All the daemons run side by side, and the
requests alternate between them one at a time (the first tree's request i, the second
tree's request i, ...; the order of the trees turns each repeat), so that every tree's
requests meet the same load from the rest of a busy host: a tree's CPU time then
differs from another's by its code, not by the minute it ran in. The supervisor and the
two workers of each daemon are found by their process titles; an idle daemon is checked
to spend no CPU time (`--idle-s`); each length gets warm-up requests first, so that its
graphs exist. Each request is a distinct prompt of random token ids (none hits the
prefix cache), streamed, max_tokens 1, greedy, ignore_eos, as the TTFT probe asks
(docs/lab/bisect/probe.py). The CPU time of a process is the sum of its threads'
run time in /proc/PID/task/*/schedstat (ns, where /proc/PID/stat counts 10 ms ticks),
read before and after a length's requests; its main thread's alone from
/proc/PID/task/PID/schedstat. The daemons get OMP_NUM_THREADS=1 (`--env`):
no OpenMP worker thread spins beside the forward, so that the graph generator's figure
is its forward and its loop.

    python docs/lab/host_time/measure.py --tree base=/work/wt/base --tree main=DIR \
        --requests 200 --lengths 10,128 --repeats 3 --out host_time.json

With `--profile DIR`, both workers of every daemon run cProfile (timed by their main
thread's CPU clock) during each length's requests, through `hook/sitecustomize.py` on the
daemon's PYTHONPATH ahead of the tree, into DIR/<tree>-<repeat>-<worker>-<length>.prof
(`profile_table.py` reads them); the CPU figures of such a run are not figures.

Lab, not product.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HYBRIDD = str(Path(sys.executable).parent / "hybridd")
TITLES = ("supervisor", "context-generator", "graph-generator")
WORKERS = TITLES[1:]


def _run_ns(task: Path) -> int:
    """A thread's time on a CPU, in ns (the scheduler's own account, not ticks)."""
    try:
        return int((task / "schedstat").read_text().split()[0])
    except FileNotFoundError:  # a thread that just ended
        return 0


def cpu(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Each process's CPU seconds: (every live thread of it; its main thread)."""
    return {t: (sum(map(_run_ns, Path(f"/proc/{p}/task").iterdir())) / 1e9, _run_ns(Path(f"/proc/{p}/task/{p}")) / 1e9)
            for t, p in pids.items()}


def per_request_us(before: dict, after: dict, requests: int) -> dict[str, dict[str, float]]:
    return {t: {"process": round((after[t][0] - before[t][0]) / requests * 1e6, 1),
                "main_thread": round((after[t][1] - before[t][1]) / requests * 1e6, 1)} for t in before}


def find_processes(root: int, timeout: float = 300.0) -> dict[str, int]:
    """The supervisor (the `hybridd start` process) and its two workers, by title."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {"supervisor": root}
        for task in Path(f"/proc/{root}/task").iterdir():
            for kid in map(int, (task / "children").read_text().split()):
                try:
                    name = Path(f"/proc/{kid}/cmdline").read_bytes().decode(errors="replace")
                except FileNotFoundError:
                    continue
                found |= {t: kid for t in WORKERS if t in name}
        if len(found) == 3:
            return found
        time.sleep(0.2)
    raise RuntimeError(f"workers not found under {root}")


def prompts(length: int, count: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids of the embedded model (vocabulary 4,096,
    ids 4 and up: no special token), each first id distinct, so that none shares a
    cached block with another."""
    rng = random.Random(seed)
    firsts = rng.sample(range(4, 4096), count)
    return [[first] + [rng.randrange(4, 4096) for _ in range(length - 1)] for first in firsts]


# ------------------------------------------------------------------ the child
def serve(args: argparse.Namespace) -> None:
    """In a child whose PYTHONPATH starts with the tree: start its daemon, say its
    processes, then send the requests the parent names on stdin ("LENGTH INDEX", one
    line each, answered "ok"; "warm LENGTH COUNT"; "quit")."""
    import hybridd
    from hybridd import Client

    base = Path(tempfile.mkdtemp(prefix="hd-host-"))
    run_dir = base / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDD_") and k != "NOTIFY_SOCKET"}
    env |= dict(kv.split("=", 1) for kv in args.env)
    if args.profile:
        env["LAB_HOST_PROFILE"] = args.profile
        env["PYTHONPATH"] = f"{HERE / 'hook'}:{env['PYTHONPATH']}"
    log = open(base / "daemon.log", "wb")
    daemon = subprocess.Popen([HYBRIDD, "start", "--runtime-dir", str(run_dir)], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    sampling = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    batches: dict[int, list[list[int]]] = {}
    try:
        with Client(f"ipc://{run_dir}/hybridd.sock") as client:
            deadline = time.monotonic() + 600
            while True:
                if daemon.poll() is not None:
                    raise RuntimeError((base / "daemon.log").read_text()[-4000:])
                try:
                    if client.health(timeout=0.5).ok:
                        break
                except hybridd.HybriddError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("not ready")
                time.sleep(0.2)

            def request(ids: list[int]) -> None:
                chunks = list(client.stream(ids, **sampling))
                assert sum(len(chunk.token_ids) for chunk in chunks) == 1, chunks

            print(json.dumps(find_processes(daemon.pid)), flush=True)
            for line in sys.stdin:
                words = line.split()
                if words[0] == "quit":
                    break
                if words[0] == "warm":
                    for ids in prompts(int(words[1]), int(words[2]), seed=1):
                        request(ids)
                else:
                    length, index = int(words[0]), int(words[1])
                    if length not in batches:
                        batches[length] = prompts(length, args.requests, seed=1000 + length)
                    request(batches[length][index])
                print("ok", flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(120)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()


# ----------------------------------------------------------------- the parent
class Tree:
    def __init__(self, name: str, path: str, args: argparse.Namespace, prefix: str | None) -> None:
        self.name, self.path = name, os.path.abspath(path)
        command = [sys.executable, __file__, "--serve", "--requests", str(args.requests)]
        command += [f"--env={kv}" for kv in args.env] + (["--profile", prefix] if prefix else [])
        self.child = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=self.path), cwd=self.path,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pids: dict[str, int] = {}

    def ready(self) -> None:
        line = self.child.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: the child ended before its daemon was ready")
        self.pids = json.loads(line)

    def ask(self, line: str) -> None:
        self.child.stdin.write(line + "\n")
        self.child.stdin.flush()
        if self.child.stdout.readline().strip() != "ok":
            raise SystemExit(f"{self.name}: no answer to {line!r}")

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.stdin.write("quit\n")
            self.child.stdin.flush()
            self.child.wait(180)


def one_repeat(args: argparse.Namespace, specs: list[tuple[str, str]], repeat: int) -> list[dict]:
    prefix = {name: f"{tempfile.mkdtemp(prefix='hd-prof-')}/profile" if args.profile else None for name, _ in specs}
    trees = [Tree(name, path, args, prefix[name]) for name, path in specs]
    try:
        for tree in trees:
            tree.ready()
        for length in args.lengths:  # every measured shape once, so that its graphs exist
            for tree in trees:
                tree.ask(f"warm {length} {args.warmup}")
        time.sleep(args.settle_s)  # what the warm-up started (a prefill capture) ends
        results = {tree.name: {"tree": tree.name, "path": tree.path, "repeat": repeat, "lengths": {}}
                   for tree in trees}
        before = {tree.name: cpu(tree.pids) for tree in trees}
        time.sleep(args.idle_s)
        for tree in trees:
            idle = per_request_us(before[tree.name], cpu(tree.pids), 1)
            results[tree.name]["idle_cpu_ms"] = {t: v["process"] / 1e3 for t, v in idle.items()}
            results[tree.name]["idle_s"] = args.idle_s
        for n, length in enumerate(args.lengths, start=1):
            if args.profile:
                for tree in trees:
                    for worker in WORKERS:
                        os.kill(tree.pids[worker], signal.SIGUSR1)
                time.sleep(0.5)
            before = {tree.name: cpu(tree.pids) for tree in trees}
            start = time.perf_counter()
            for index in range(args.requests):
                for tree in trees:
                    tree.ask(f"{length} {index}")
            wall = time.perf_counter() - start
            for tree in trees:
                results[tree.name]["lengths"][str(length)] = {
                    "cpu_us_per_request": per_request_us(before[tree.name], cpu(tree.pids), args.requests),
                    "wall_us_per_request_all_trees": round(wall / args.requests * 1e6, 1),
                }
            if args.profile:
                for tree in trees:
                    for worker in WORKERS:
                        os.kill(tree.pids[worker], signal.SIGUSR2)
                        written = Path(f"{prefix[tree.name]}-{tree.pids[worker]}-{n}.prof")
                        deadline = time.monotonic() + 60
                        while not written.exists() and time.monotonic() < deadline:
                            time.sleep(0.1)
                        time.sleep(0.5)  # written whole
                        written.rename(Path(args.profile) / f"{tree.name}-{repeat}-{worker}-{length}.prof")
        return [results[tree.name] for tree in trees]
    finally:
        for tree in trees:
            tree.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR (two or more)")
    parser.add_argument("--requests", type=int, default=200, help="per tree and length")
    parser.add_argument("--lengths", default="10,128")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--env", action="append", default=None,
                        help="K=V for the daemons' environment (default OMP_NUM_THREADS=1)")
    parser.add_argument("--profile", default=None, help="a directory: run the workers under cProfile")
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.env = args.env or ["OMP_NUM_THREADS=1"]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.serve:
        serve(args)
        return
    if args.profile:
        args.profile = os.path.abspath(args.profile)
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    specs = [tuple(spec.split("=", 1)) for spec in args.tree]
    runs: list[dict] = []
    for repeat in range(args.repeats):
        order = specs if repeat % 2 == 0 else specs[::-1]
        for run in one_repeat(args, order, repeat):
            runs.append(run)
            print(json.dumps(run), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(runs, indent=1))
    names = [name for name, _ in specs]
    print("\nCPU µs per request (median of the repeats; each repeat in brackets)")
    for length in args.lengths:
        for t in TITLES:
            for part in ("process", "main_thread"):
                row = []
                for name in names:
                    values = [r["lengths"][str(length)]["cpu_us_per_request"][t][part]
                              for r in runs if r["tree"] == name]
                    row.append(f"{name} {statistics.median(values):8.0f} [{', '.join(f'{v:.0f}' for v in values)}]")
                print(f"{length:4d} tokens {t:18s} {part:12s} " + "  ".join(row))


if __name__ == "__main__":
    main()
