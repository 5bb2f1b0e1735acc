"""Prefill projections on cuBLASLt algorithms of our choosing, against PyTorch's cuBLAS call.

For every projection shape of Llama-2-7B and Llama-3-8B at prefill row counts: the
product as the model runs it now (`F.linear`, and for o and down `addmm_` adding into
the residual stream in place), then every algorithm cuBLASLt's heuristic names for it
(`hybridd.kernels.cublaslt`), and splits of K of the first few, each checked against
PyTorch's result before it is timed. With `--exhaustive`, also the configurations the
heuristic's algorithms accept beyond its own (each tile, custom option, swizzle and
cluster shape they list, at the heuristic's stages): first those that share a tile with
one of its candidates, then others drawn at random, up to `--limit` a cell; then K split
in the three fastest. The fastest few and PyTorch's call are timed
again in turns (`--rounds`), and the cell's best is the one with the lowest median of
those rounds. Ends with the entries for `prefill_gemm._TABLE` (the cells where an
algorithm beat PyTorch's call by 3 % or more).

Each time is one call's share of a CUDA graph of calls rotating over copies of the
weight (about 250 MB of them, so that no call reads its weight from L2), the median
over ten replays; the share of the copy bandwidth counts the weight, the input and the
output.

    python scripts/bench_cublaslt.py --out bench_cublaslt.json [--rows 64,128,256]
    python scripts/bench_cublaslt.py --out bench_cublaslt.json --rows 128,256 --exhaustive \
        --shapes "llama2-7b o +=,llama2-7b down +=" --table-out winners.json

`--table-out` writes the entries as JSON; `scripts/bench_pdl_steps.py` tries them in the
graph steps beside the table as it is (`--policies "code,code with table=winners.json"`),
since a product faster alone is not always faster in the step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_blas import SHAPES, bandwidth_share, start_sweep, time_calls  # noqa: E402
from bench_sampler import sizes  # noqa: E402
from hybridd.kernels import cublaslt, prefill_gemm  # noqa: E402

WORKSPACE_BYTES = prefill_gemm.CANDIDATE_WORKSPACE_BYTES
ACCUMULATED = ("o", "down")  # the projections whose product the model adds to the stream


def split_variants(product: cublaslt.LtProduct, unsplit: list[cublaslt.Candidate]) -> list[cublaslt.Candidate]:
    """K split 2-8 ways, each reduction scheme, in each of `unsplit`."""
    variants = []
    for candidate in unsplit:
        for split in (2, 3, 4, 6, 8):
            for reduction in (1, 2, 4):
                variant = product.variant(candidate, split_k=split, reduction=reduction)
                if variant is not None and variant.workspace_bytes <= WORKSPACE_BYTES:
                    variants.append(variant)
    return variants


def candidates(product: cublaslt.LtProduct, splits_of: int) -> list[cublaslt.Candidate]:
    """The heuristic's algorithms, then K split 2-8 ways in the first `splits_of` unsplit ones."""
    found = product.candidates(WORKSPACE_BYTES, count=prefill_gemm.CANDIDATES)
    return found + split_variants(product, [c for c in found if c.config.get("split_k", 1) <= 1][:splits_of])


def configurations(product: cublaslt.LtProduct, heuristic: list[cublaslt.Candidate], limit: int,
                   seed: int) -> tuple[list[cublaslt.Candidate], int]:
    """Configurations of the heuristic's algorithms the library accepts, at the stages
    the heuristic chose for each, less those already in `heuristic`: first every one that
    shares a tile with a heuristic candidate (its other cluster shapes, custom options and
    swizzles), then others drawn at random, at most `limit` in all. Also how many there were."""
    seen = {_key(c.config) for c in heuristic}
    stages: dict[int, set[int]] = {}
    for candidate in heuristic:
        stages.setdefault(candidate.config["algo_id"], set()).add(candidate.config.get("stages", 0))
    tiles = {(c.config["algo_id"], c.config.get("tile", 0)) for c in heuristic}
    near, far = [], []
    for algo_id, algo_stages in stages.items():
        for candidate in product.configurations(algo_id, stages=sorted(algo_stages)):
            if candidate.workspace_bytes <= WORKSPACE_BYTES and _key(candidate.config) not in seen:
                seen.add(_key(candidate.config))
                (near if (algo_id, candidate.config.get("tile", 0)) in tiles else far).append(candidate)
    total = len(near) + len(far)
    near = near[:limit]
    return near + random.Random(seed).sample(far, min(len(far), limit - len(near))), total


def _key(config: dict[str, int]) -> tuple:
    return tuple(sorted(config.items()))


def measure(m: int, n: int, k: int, accumulate: bool, splits_of: int, exhaustive: bool = False,
            limit: int = 1000, rounds: int = 5, finalists: int = 6) -> dict:
    copies = max(2, int(2.5e8 // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    base = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    out = base.clone()
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    if accumulate:
        def torch_call(i):
            out.addmm_(x, weights[i].t())
        reference = base + F.linear(x, weights[0])
    else:
        def torch_call(i):
            torch.mm(x, weights[i].t(), out=out)
        reference = F.linear(x, weights[0])
    cell = {"torch_s": time_calls(torch_call, copies), "candidates": []}
    product = cublaslt.LtProduct(m, n, k, torch.bfloat16, accumulate=accumulate)
    tried = candidates(product, splits_of)
    cell["heuristic_and_splits"] = len(tried)  # the candidates before the enumeration's
    if exhaustive:
        extra, cell["configurations_accepted"] = configurations(product, tried, limit, seed=m * n + k)
        tried += extra
    kept: dict[int, cublaslt.Candidate] = {}

    def try_candidates(batch: list[cublaslt.Candidate]) -> None:
        for candidate in batch:
            index = len(cell["candidates"])
            out.copy_(base)
            try:
                product(x, weights[0], out, candidate, workspace)
                torch.cuda.synchronize()
            except cublaslt.CublasLtError as exc:
                cell["candidates"].append({"index": index, "config": candidate.config, "error": str(exc)})
                continue
            error = (out.float() - reference.float()).abs().max().item()
            entry = {"index": index, "config": candidate.config, "workspace_bytes": candidate.workspace_bytes,
                     "max_abs_error": error}
            if error <= 0.05 + 0.02 * reference.float().abs().max().item():
                entry["seconds"] = time_calls(lambda i: product(x, weights[i], out, candidate, workspace), copies)
                kept[index] = candidate
            cell["candidates"].append(entry)

    try_candidates(tried)
    if exhaustive:  # K split in the fastest unsplit configurations
        unsplit = sorted((c for c in cell["candidates"] if "seconds" in c and c["config"].get("split_k", 1) <= 1),
                         key=lambda c: c["seconds"])[:3]
        try_candidates(split_variants(product, [kept[c["index"]] for c in unsplit]))
    timed = [c for c in cell["candidates"] if "seconds" in c]
    cell["first"] = timed[0] if timed and timed[0]["index"] == 0 else None
    # The fastest few again, in turns with PyTorch's call: the best of a thousand single
    # timings is biased low by their noise; the median of a few rounds is not.
    finalists_ = sorted(timed, key=lambda c: c["seconds"])[:finalists]
    medians: dict[int | str, list[float]] = {"torch": [], **{c["index"]: [] for c in finalists_}}
    for _ in range(rounds):
        medians["torch"].append(time_calls(torch_call, copies))
        for c in finalists_:
            candidate = kept[c["index"]]
            medians[c["index"]].append(time_calls(lambda i: product(x, weights[i], out, candidate, workspace), copies))
    if rounds:
        cell["torch_s"] = statistics.median(medians["torch"])
        for c in finalists_:
            c["seconds_rounds"] = statistics.median(medians[c["index"]])
        cell["best"] = min(finalists_, key=lambda c: c["seconds_rounds"]) if finalists_ else None
    else:
        cell["best"] = finalists_[0] if finalists_ else None
    return cell


def table_entries(results: dict, margin: float = 0.03) -> dict[tuple, dict[str, int]]:
    """`prefill_gemm._TABLE`'s entries from a run: each cell whose best algorithm took
    less than (1 - margin) of PyTorch's call's time."""
    entries = {}
    for m, cells in results["rows"].items():
        for label, cell in cells.items():
            n, k = SHAPES[label.removesuffix(" +=")]
            best = cell["best"]
            if best and _seconds(best) < (1 - margin) * cell["torch_s"]:
                entries[(results["device"], int(m), n, k, label.endswith(" +="))] = best["config"]
    return entries


# An entry of a table file as `write_table` writes it: each field's type.
_TABLE_FIELDS = {"gpu": str, "rows": int, "n": int, "k": int, "accumulate": bool, "config": dict}


def write_table(path: Path, entries: dict[tuple, dict[str, int]]) -> None:
    """`table_entries` as JSON, for `bench_pdl_steps.py`'s `table=PATH` to try in the steps."""
    path.write_text(json.dumps([{"gpu": gpu, "rows": m, "n": n, "k": k, "accumulate": accumulate, "config": config}
                                for (gpu, m, n, k, accumulate), config in entries.items()], indent=1) + "\n")


def read_table(path: Path) -> dict[tuple, dict[str, int]]:
    """Table entries written by `write_table`; ValueError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a table of entries: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a table is a list of entries, got {type(data).__name__}")
    entries = {}
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or set(entry) != set(_TABLE_FIELDS):
            raise ValueError(f"{path}: entry {i} must have exactly {', '.join(_TABLE_FIELDS)}")
        wrong = [name for name, kind in _TABLE_FIELDS.items()
                 if not isinstance(entry[name], kind) or (kind is int and isinstance(entry[name], bool))]
        config = entry["config"]
        if wrong or "algo_id" not in config or not all(isinstance(v, int) for v in config.values()):
            raise ValueError(f"{path}: entry {i}: {', '.join(wrong) or 'config'} malformed "
                             "(config maps attribute names to integers and names its algo_id)")
        entries[(entry["gpu"], entry["rows"], entry["n"], entry["k"], entry["accumulate"])] = config
    return entries


def _seconds(candidate: dict) -> float:
    """A timed candidate's time: the median of its rounds where it had them."""
    return candidate.get("seconds_rounds", candidate["seconds"])


def table_source(config: dict[str, int]) -> str:
    """A configuration as `prefill_gemm._TABLE` writes it: `_lt(...)` with the attributes
    that differ from `_lt`'s defaults."""
    defaults = prefill_gemm._lt()
    return "_lt(" + ", ".join(f"{key}={value}" for key, value in config.items() if defaults.get(key) != value) + ")"


def count_from(least: int):
    """An argparse type: an integer of at least `least`."""
    def count(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
        if number < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {number}")
        return number
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_cublaslt.json"))
    parser.add_argument("--rows", type=sizes, default=[64, 128, 256])
    parser.add_argument("--splits-of", type=count_from(0), default=4,
                        help="split K in this many of the heuristic's first unsplit algorithms")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated projections of {', '.join(SHAPES)}; o or down with ' +=' "
                             "for only the product added to the residual stream")
    parser.add_argument("--exhaustive", action="store_true",
                        help="also every configuration the heuristic's algorithms accept")
    parser.add_argument("--limit", type=count_from(1), default=1000,
                        help="with --exhaustive, at most this many configurations a cell")
    parser.add_argument("--table-out", type=Path,
                        help="also write the table's entries as JSON (for bench_pdl_steps.py's table=PATH)")
    parser.add_argument("--rounds", type=count_from(0), default=5,
                        help="time the fastest few and PyTorch's call again this many times, in turns")
    args, bandwidth, results = start_sweep(parser)

    def share(m, n, k, seconds):
        return bandwidth_share(m, n, k, seconds, bandwidth)

    shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
    unknown = [name for name in shapes if name.removesuffix(" +=") not in SHAPES]
    if unknown:
        parser.error(f"unknown projection {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    for m in args.rows:
        for asked in shapes:
            name = asked.removesuffix(" +=")
            n, k = SHAPES[name]
            ways = (False, True) if name.split()[-1] in ACCUMULATED else (False,)
            for accumulate in (True,) if asked.endswith(" +=") else ways:
                label = name + (" +=" if accumulate else "")
                cell = measure(m, n, k, accumulate, args.splits_of, args.exhaustive, args.limit, args.rounds)
                results["rows"].setdefault(str(m), {})[label] = cell
                line = f"M={m:4d} {label:20s} torch {cell['torch_s'] * 1e6:6.1f} us ({share(m, n, k, cell['torch_s']):4.0%})"
                for key in ("first", "best"):
                    if cell[key]:
                        s = _seconds(cell[key])
                        line += f"  {key} {s * 1e6:6.1f} us ({share(m, n, k, s):4.0%})"
                if cell["best"]:
                    line += f"  [{len(cell['candidates'])} tried; best {cell['best']['index']}: " \
                            f"{' '.join(f'{k}={v}' for k, v in cell['best']['config'].items())}]"
                print(line, flush=True)
                args.out.write_text(json.dumps(results, indent=1))  # each cell kept as it comes
    print("prefill_gemm._TABLE entries (3 % faster or more):")
    if args.table_out:
        write_table(args.table_out, table_entries(results))
    for key, config in table_entries(results).items():
        print(f"    {key!r}:\n        {table_source(config)},")
    return 0


if __name__ == "__main__":
    sys.exit(main())
