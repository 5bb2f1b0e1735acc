"""Benchmark of the skinny projections (hybridd/kernels/triton_gemm.py) against cuBLAS.

    python scripts/bench_gemm.py --out $OUT                 # the table in the code vs cuBLAS
    python scripts/bench_gemm.py --sweep --out $OUT         # sweep configs, print a new table
    python scripts/bench_gemm.py --decode-step --out $OUT   # also one 7B decode step, both ways
    python scripts/bench_gemm.py --skip-compare --decode-step --decode-batch 1,32 --out $OUT
    python scripts/bench_gemm.py --skip-compare --shapes "llama2-7b o" --configs 64:128:1:4:7 --out $OUT

Every projection of Llama-2-7B and Llama-3-8B in bf16 for M = 1..32 token rows: time per
call and the share of the measured copy bandwidth (bytes read plus written by a large
device-to-device copy) that the weight read reaches, for the skinny kernel and for
torch.nn.functional.linear (cuBLAS). Each time is the median of CUDA-graph replays of
back-to-back calls over enough copies of the weight that none is served from L2.
`--decode-step` builds the Llama-2-7B shape (or `--decode-shape llama3-8b`) with random
weights and times one decode step (graph replay, batch 1 or each of `--decode-batch`,
context 512 or `--decode-context`) with cuBLAS, the skinny kernels, each set of fused
neighbours and other projection configs (`--variants` picks some; a variant may also be
written `BASE with CHANGE ...`, see `composed_variant`). `--shapes` times each config of
`--configs` alone on those projections at `--rows`, beside the table's config and
cuBLAS. `--old-attention FILE` times each step
also with the `decode_attention` of FILE (e.g. an earlier
hybridd/kernels/triton_attention.py), the two interleaved over two rounds. Results are
written to bench_gemm.json under --out (the sweep's table also to gemm_table.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_graphs import copy_bandwidth, median_gpu_time, time_calls_in_graph  # noqa: E402
from make_random_checkpoint import PRESETS  # noqa: E402
from hybridd.kernels import gemm_fusions  # noqa: E402
from hybridd.kernels import pdl, triton_gemm  # noqa: E402
from hybridd.kernels.triton_gemm import GemmConfig  # noqa: E402

# name -> (N, K)
SHAPES = {
    "llama2-7b qkv": (12288, 4096),
    "llama2-7b o": (4096, 4096),
    "llama2-7b gate_up": (22016, 4096),
    "llama2-7b down": (4096, 11008),
    "llama2-7b lm_head": (32000, 4096),
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
    "llama3-8b lm_head": (128256, 4096),
}
ROWS = (1, 2, 4, 7, 8, 16, 24, 32)
BUCKET_EDGES = (1, 2, 4, 8, 16, 24, 32)
CANDIDATES = [
    GemmConfig(bn, bk, 1, w, s)
    for bn, bk, w, s in [
        (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4), (32, 256, 4, 6),
        (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (64, 256, 4, 4), (64, 256, 8, 4),
        (128, 64, 4, 6), (128, 128, 4, 4), (128, 128, 8, 4), (128, 128, 8, 5), (256, 64, 8, 4),
    ]
]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
ROTATE_BYTES = 400 << 20  # several times the H200's 50 MB L2


class Operands:
    """Copies of one shape's weight (and inputs) to rotate through, so each call reads DRAM."""

    def __init__(self, n: int, k: int, rows: int = 32):
        self.n, self.k = n, k
        copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
        g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        self.weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        self.inputs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(copies)]

    def bytes(self, m: int) -> int:
        return self.n * self.k * 2 + m * self.k * 2 + m * self.n * 2


def time_per_call(fn, ops: Operands, m: int, min_calls: int = 24) -> float:
    """Median seconds per call of fn(x, w), from CUDA-graph replays over the rotated copies."""
    return time_calls_in_graph([lambda x=x, w=w: fn(x[:m], w) for x, w in zip(ops.inputs, ops.weights)], min_calls)


def check(fn, ops: Operands, m: int) -> float:
    x, w = ops.inputs[0][:m], ops.weights[0]
    ref = F.linear(x, w).float()
    out = fn(x, w).float()
    return ((out - ref).norm() / ref.norm()).item()


def skinny(config: GemmConfig):
    def fn(x, w):
        y = triton_gemm.launch(x, w, None, config)
        if y is None:
            raise RuntimeError("config cannot run this shape")
        return y

    return fn


def cublas(x, w):
    return F.linear(x, w)


def splits_for(n: int, k: int, config: GemmConfig, block_m: int) -> list[int]:
    tiles = -(-n // config.block_n)
    out = []
    for s in SPLITS:
        if s > 1 and (tiles * s > 1200 or s * block_m * n > triton_gemm._WORKSPACE_FLOATS or k // s < config.block_k):
            continue
        out.append(s)
    return out


def variants():
    """Every (shape, rows, config) the sweep times, rows 1 (BLOCK_M 16) and 32 (BLOCK_M 32)."""
    for name, (n, k) in SHAPES.items():
        for m in (1, 32):
            for base in CANDIDATES:
                for s in splits_for(n, k, base, 16 if m <= 16 else 32):
                    yield name, n, k, m, GemmConfig(base.block_n, base.block_k, s, base.num_warps, base.num_stages)


def _compile(tasks: list) -> int:
    """Compile (by one small launch each) in a worker process; fills Triton's disk cache."""
    done = 0
    for n, k, m, config in tasks:
        try:
            nn = min(n, 2 * config.block_n * 4)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(nn, k, device="cuda", dtype=torch.bfloat16)
            # The same specialisation as the real shape: N only through its divisibility by 16.
            triton_gemm.launch(x, w, None, config)
            done += 1
        except Exception:
            pass
    torch.cuda.synchronize()
    return done


def precompile(tasks: list, workers: int = 14) -> None:
    seen, unique = set(), []
    for n, k, m, config in tasks:
        split = max(1, min(config.split_k, -(-k // config.block_k)))
        kps = -(-(-(-k // split)) // config.block_k) * config.block_k
        key = (config.block_n, config.block_k, config.num_warps, config.num_stages, config.block_m or m <= 16,
               -(-k // kps) > 1, k % kps == 0)
        if key not in seen:
            seen.add(key)
            unique.append((n, k, m, config))
    t0 = time.perf_counter()
    chunks = [unique[i::workers] for i in range(workers)]
    import multiprocessing as mp

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(_compile, chunks))
    print(f"precompiled {done}/{len(unique)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)


def sweep(bw: float, results: dict) -> dict:
    """Best config per shape and BLOCK_M; then per row bucket, the kernel or cuBLAS."""
    precompile([(n, k, m, c) for _, n, k, m, c in variants()])
    best: dict = {}
    rows_out = []
    t0 = time.perf_counter()
    for name, (n, k) in SHAPES.items():
        ops = Operands(n, k)
        for m in (1, 32):
            timings = []
            for base in CANDIDATES:
                for s in splits_for(n, k, base, 16 if m <= 16 else 32):
                    c = GemmConfig(base.block_n, base.block_k, s, base.num_warps, base.num_stages)
                    try:
                        err = check(skinny(c), ops, m)
                        if not err < 1e-2:
                            print(f"WRONG {name} m={m} {c}: rel err {err}", flush=True)
                            continue
                        t = time_per_call(skinny(c), ops, m)
                    except Exception as e:  # out of shared memory and the like
                        print(f"skip {name} m={m} {c}: {type(e).__name__} {str(e)[:80]}", flush=True)
                        continue
                    timings.append((t, c))
            timings.sort(key=lambda tc: tc[0])
            best[(name, m)] = timings[:3]
            t_cub = time_per_call(cublas, ops, m)
            for t, c in timings[:3]:
                rows_out.append({"shape": name, "m": m, "config": c.__dict__, "s": t, "bw": ops.bytes(m) / t / bw,
                                 "cublas_s": t_cub})
            print(f"{name:18s} m={m:2d} cublas {t_cub * 1e6:7.1f} us {ops.bytes(m) / t_cub / bw:5.1%}  best "
                  + "  ".join(f"{t * 1e6:7.1f} us {ops.bytes(m) / t / bw:5.1%} {c}" for t, c in timings[:3]), flush=True)
        del ops
        torch.cuda.empty_cache()
    print(f"sweep timed in {time.perf_counter() - t0:.1f} s", flush=True)
    results["sweep"] = rows_out
    # The table: per row bucket, the best of the three best configs of its BLOCK_M, where it
    # beats cuBLAS by more than 1 %.
    table: dict = {}
    for name, (n, k) in SHAPES.items():
        ops = Operands(n, k)
        entries = []
        for edge in BUCKET_EDGES:
            t_base = time_per_call(cublas, ops, edge)
            timed = sorted((time_per_call(skinny(c), ops, edge), c) for _, c in best[(name, 1 if edge <= 16 else 32)])
            choice = timed[0][1] if timed and timed[0][0] < t_base * 0.99 else None
            entries.append((edge, choice))
            print(f"table {name:18s} m<={edge:2d} cuBLAS {t_base * 1e6:7.1f} us "
                  f"skinny {timed[0][0] * 1e6 if timed else float('nan'):7.1f} us -> {choice}", flush=True)
        merged = []
        for edge, choice in entries:
            if merged and merged[-1][1] == choice:
                merged[-1] = (edge, choice)
            else:
                merged.append((edge, choice))
        table[(n, k)] = merged
        del ops
        torch.cuda.empty_cache()
    return table


# Prefill row counts past 32 (`--mid-rows`): configs whose tile holds every row.
MID_CANDIDATES = [
    (bn, bk, w, s) for bn in (64, 128) for bk in (64, 128) for w in (4, 8) for s in (3, 4)
]


def mid_variants(rows: list[int]):
    for name, (n, k) in SHAPES.items():
        for m in rows:
            block_m = max(16, 1 << (m - 1).bit_length())
            for bn, bk, w, s in MID_CANDIDATES:
                for split in (1, 2, 4):
                    # Splits only where the N tiles alone leave multiprocessors idle.
                    if split > 1 and (-(-n // bn) * split > 4 * 132 or k // split < bk):
                        continue
                    yield name, n, k, m, GemmConfig(bn, bk, split, w, s, block_m)


def sweep_mid(bw: float, results: dict, rows: list[int]) -> None:
    """Configs for `rows` token rows (one tile of all of them) against cuBLAS, per shape:
    the three best and cuBLAS, printed and kept in results["mid_sweep"]."""
    variants = list(mid_variants(rows))
    precompile([(n, k, m, c) for _, n, k, m, c in variants])
    out = []
    results["mid_sweep"] = out
    by_shape: dict = {}
    for name, n, k, m, c in variants:
        by_shape.setdefault((name, n, k), {}).setdefault(m, []).append(c)
    for (name, n, k), per_m in by_shape.items():
        ops = Operands(n, k, max(rows))
        for m, configs in per_m.items():
            t_cub = time_per_call(cublas, ops, m)
            timings = []
            for c in configs:
                try:
                    err = check(skinny(c), ops, m)
                    if not err < 1e-2:
                        print(f"WRONG {name} m={m} {c}: rel err {err}", flush=True)
                        continue
                    timings.append((time_per_call(skinny(c), ops, m), c))
                except Exception:  # out of shared memory and the like
                    continue
            timings.sort(key=lambda tc: tc[0])
            out.append({"shape": name, "m": m, "cublas_s": t_cub,
                        "best": [{"s": t, "config": c.__dict__} for t, c in timings[:5]]})
            print(f"{name:18s} m={m:3d} cublas {t_cub * 1e6:7.1f} us {ops.bytes(m) / t_cub / bw:5.1%}  best "
                  + "  ".join(f"{t * 1e6:7.1f} us {ops.bytes(m) / t / bw:5.1%} {c}" for t, c in timings[:3]), flush=True)
        del ops
        torch.cuda.empty_cache()


CONFIG_SYNTAX = "block_n:block_k:split:warps:stages[:mROWS][:pCOLUMNS]"


def config_from(text: str) -> GemmConfig:
    """block_n:block_k:split:warps:stages, then optionally :mROWS (a tile of ROWS rows, for
    more than 32) and :pCOLUMNS (columns of each weight row prefetched into L2 before the
    wait for the previous kernel). ValueError naming what is wrong."""
    parts = text.split(":")
    extra = {"m": "block_m", "p": "prefetch_k"}
    options = {}
    while len(parts) > 5 and parts[-1][:1] in extra and parts[-1][1:].isdigit() and extra[parts[-1][0]] not in options:
        token = parts.pop()
        options[extra[token[0]]] = int(token[1:])
    if len(parts) != 5 or not all(n.isdigit() for n in parts):
        raise ValueError(f"a config is {CONFIG_SYNTAX}, got {text!r}")
    return GemmConfig(*(int(n) for n in parts), **options)


def config_label(c: GemmConfig) -> str:
    """A config as `config_from` reads it."""
    return (f"{c.block_n}:{c.block_k}:{c.split_k}:{c.num_warps}:{c.num_stages}"
            + (f":m{c.block_m}" if c.block_m else "") + (f":p{c.prefetch_k}" if c.prefetch_k else ""))


def parse_configs(text: str) -> list[GemmConfig]:
    """--configs: a comma list of configs as `config_from` reads them."""
    try:
        return [config_from(part) for part in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"a comma list of {CONFIG_SYNTAX}, "
                                         f"got {text!r}: {e}") from e


def time_configs(bw: float, results: dict, shapes: list[str], configs: list[GemmConfig], rows: list[int]) -> None:
    """Each of `configs` on each projection of `shapes` (names of SHAPES) alone, at each row
    count, beside the table's config and cuBLAS: printed and kept in results["configs"]."""
    out = []
    results["configs"] = out
    for name in shapes:
        n, k = SHAPES[name]
        ops = Operands(n, k, max(rows))
        for m in rows:
            table = triton_gemm.config_for(m, n, k)
            timed = [("cuBLAS", time_per_call(cublas, ops, m))]
            for c in ([table] if table else []) + [c for c in configs if c != table]:
                label = config_label(c) + (" (table)" if c == table else "")
                try:
                    err = check(skinny(c), ops, m)
                    if not err < 1e-2:
                        print(f"WRONG {name} m={m} {c}: rel err {err}", flush=True)
                        continue
                    timed.append((label, time_per_call(skinny(c), ops, m)))
                except Exception as e:  # out of shared memory and the like
                    print(f"skip {name} m={m} {label}: {type(e).__name__} {str(e)[:80]}", flush=True)
            for label, t in timed:
                out.append({"shape": name, "m": m, "config": label, "s": t, "bw": ops.bytes(m) / t / bw})
                print(f"{name:18s} m={m:2d} {label:22s} {t * 1e6:7.2f} us {ops.bytes(m) / t / bw:6.1%}", flush=True)
        del ops
        torch.cuda.empty_cache()


def table_source(table: dict) -> str:
    lines = ["_TABLE: dict[tuple[int, int], list[tuple[int, GemmConfig | None]]] = {"]
    for (n, k), entries in sorted(table.items()):
        parts = []
        for edge, c in entries:
            parts.append(f"({edge}, None)" if c is None else
                         f"({edge}, GemmConfig({c.block_n}, {c.block_k}, {c.split_k}, {c.num_warps}, {c.num_stages}))")
        lines.append(f"    ({n}, {k}): [{', '.join(parts)}],")
    lines.append("}")
    return "\n".join(lines)


def compare(bw: float, results: dict) -> None:
    """The table in the code (through triton_gemm.linear) against cuBLAS, per shape and rows."""
    rows_out = []
    results["compare"] = rows_out
    print("\nshape              |  M | cuBLAS us | cuBLAS %bw | skinny us | skinny %bw | speed-up")
    for name, (n, k) in SHAPES.items():
        ops = Operands(n, k)
        for m in ROWS:
            t_c = time_per_call(cublas, ops, m)
            err = check(lambda x, w: triton_gemm.linear(x, w), ops, m)
            t_s = time_per_call(lambda x, w: triton_gemm.linear(x, w), ops, m)
            used = triton_gemm.config_for(m, n, k)
            row = {"shape": name, "m": m, "cublas_s": t_c, "skinny_s": t_s, "cublas_bw": ops.bytes(m) / t_c / bw,
                   "skinny_bw": ops.bytes(m) / t_s / bw, "rel_err": err, "config": used.__dict__ if used else None}
            rows_out.append(row)
            print(f"{name:18s} | {m:2d} | {t_c * 1e6:9.1f} | {row['cublas_bw']:10.1%} | {t_s * 1e6:9.1f} | "
                  f"{row['skinny_bw']:10.1%} | {t_c / t_s:6.2f}x{'' if used else '  (cuBLAS)'}", flush=True)
        del ops
        torch.cuda.empty_cache()


# The decode step's model shapes (`--decode-shape`): the random checkpoints' presets.
STEP_SHAPES = ("llama2-7b", "llama3-8b")


def step_config(shape: str):
    """The ModelConfig of a `--decode-shape`."""
    from hybridd.model.config import ModelConfig

    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", **PRESETS[shape],
    })


# The decode attention's knobs a step variant may set, as `attn.NAME`.
# The persistent MLP kernel's knobs (`mlp.EARLY`: 0 or 1; `mlp.PER_SM`) and its
# tiles (`mlp.CONFIG=GATE_UP_N:GATE_UP_K:GATE_UP_STAGES:DOWN_N:DOWN_K:DOWN_STAGES`).
KNOBS = ("attn.BATCH1_PROGRAMS", "attn.BATCH1_WARPS", "attn.BATCH1_STAGES", "attn.BATCH1_TILE",
         "mlp.EARLY", "mlp.PER_SM", "mlp.CONFIG")


def _knob_module(name: str):
    from hybridd.kernels import triton_attention, triton_mlp

    return {"attn": triton_attention, "mlp": triton_mlp}[name.split(".")[0]]


def mlp_config_from(text: str):
    """An MlpConfig from `GATE_UP_N:GATE_UP_K:GATE_UP_STAGES:DOWN_N:DOWN_K:DOWN_STAGES`."""
    from hybridd.kernels.triton_mlp import MlpConfig

    fields = text.split(":")
    if len(fields) != 6 or not all(f.isdigit() and int(f) > 0 for f in fields):
        raise ValueError(f"mlp.CONFIG takes six positive integers "
                         f"GATE_UP_N:GATE_UP_K:GATE_UP_STAGES:DOWN_N:DOWN_K:DOWN_STAGES, got {text!r}")
    return MlpConfig(*map(int, fields))


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """The (N, K) of each projection of a model of `cfg`, by name."""
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "o": (cfg.hidden_size, cfg.q_size),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def composed_variant(label: str, known: dict, cfg) -> tuple:
    """A step variant written as `BASE with CHANGE ...`: BASE a variant of `step_variants`,
    each CHANGE either PROJECTION=CONFIG (`config_from`; that projection's
    config at every row count) or a knob of `KNOBS`=integer. ValueError naming what is
    wrong."""
    base, _, changes = label.partition(" with ")
    if base not in known:
        raise ValueError(f"no variant named {base!r} to build {label!r} on")
    skinny_on, fused, with_pdl, prefetch, table, knobs = known[base]
    table, knobs = dict(table), dict(knobs)
    shapes = projection_shapes(cfg)
    for change in changes.split():
        name, eq, value = change.partition("=")
        if not eq or not value:
            raise ValueError(f"{change!r} in {label!r}: want NAME=integer or PROJECTION={CONFIG_SYNTAX}")
        if name in shapes:
            try:
                table[shapes[name]] = [(32, config_from(value))]
            except ValueError as e:
                raise ValueError(f"{change!r}: {e}") from None
        elif name == "mlp.CONFIG":
            knobs[name] = mlp_config_from(value)
        elif name in KNOBS:
            if not value.lstrip("-").isdigit():
                raise ValueError(f"{change!r} in {label!r}: a knob takes an integer")
            default = getattr(_knob_module(name), name.split(".")[1])
            knobs[name] = type(default)(int(value))
        else:
            raise ValueError(f"{change!r}: no projection or knob {name!r} (projections {', '.join(shapes)}; "
                             f"knobs {', '.join(KNOBS)})")
    return skinny_on, fused, with_pdl, prefetch, table, knobs


def step_variants(cfg, with_pdl: bool) -> dict[str, tuple]:
    """label -> (projections on the skinny kernel, fused neighbours, PDL on, GEMM prefetch
    columns, table entries replaced, decode attention knobs set): the decode step's
    variants for a model of `cfg` (the PDL ones only `with_pdl`)."""
    variants = {"cublas": (False, "none", False, 0, {}, {}), "skinny": (True, "none", False, 0, {}, {})}
    for fused in ("norm", "rotary", "silu", "norm,rotary", "norm,rotary,silu", "norm,rotary,mlp"):
        variants[f"skinny+{fused.replace(',', '+')}"] = (True, fused, False, 0, {}, {})
    default = gemm_fusions.DEFAULT.replace(",", "+")
    # The o and down projections fill only 64 of the GPU's multiprocessors with the table's
    # configs; in the step (after attention, before a norm) more programs may pay.
    # At 9-32 rows gate/up goes to cuBLAS, which then leaves its norm to a kernel of its
    # own; Llama-3-8B's qkv fills only 96 multiprocessors.
    o, down = (4096, 4096), (4096, cfg.intermediate_size)
    gate_up, qkv = (2 * cfg.intermediate_size, 4096), (cfg.q_size + 2 * cfg.kv_size, 4096)
    for name, weight, config in (("o split2", o, GemmConfig(64, 256, 2)), ("o bn32", o, GemmConfig(32, 256)),
                                 ("down split2", down, GemmConfig(64, 256, 2)),
                                 ("down bn32", down, GemmConfig(32, 256)), ("o+down split2", None, GemmConfig(64, 256, 2)),
                                 ("o k128", o, GemmConfig(64, 128, 1, 4, 6)), ("down k128", down, GemmConfig(64, 128, 1, 4, 6)),
                                 ("gate_up skinny", gate_up, GemmConfig(64, 256)),
                                 ("gate_up skinny k128", gate_up, GemmConfig(64, 128)),
                                 ("gate_up skinny n128", gate_up, GemmConfig(128, 128)),
                                 ("qkv split2", qkv, GemmConfig(64, 128, 2)),
                                 ("qkv bn32", qkv, GemmConfig(32, 128))):
        table = {w: [(32, config)] for w in ((o, down) if weight is None else (weight,))}
        variants[f"skinny+{default} {name}"] = (True, gemm_fusions.DEFAULT, False, 0, table, {})
        if with_pdl and name.startswith(("o ", "down ", "o+down ")):
            # The o and down configs that lost without dependent launch, with it.
            variants[f"skinny+{default}+pdl {name}"] = (True, gemm_fusions.DEFAULT, True, 0, table, {})
    if with_pdl:
        variants |= {f"skinny+{default}+pdl+prefetch{c}": (True, gemm_fusions.DEFAULT, True, c, {}, {}) for c in (0, 512)}
        # The decode attention's batch-1 program target (hybridd/kernels/triton_attention.py).
        variants[f"skinny+{default}+pdl attn b1 128 programs"] = (True, gemm_fusions.DEFAULT, True, 0, {},
                                                                  {"attn.BATCH1_PROGRAMS": 128})
        # The other sets of epilogue fusions, with dependent launch.
        for fused in ("norm", "norm,rotary", "norm,silu", "norm,rotary,silu", "norm,rotary,mlp"):
            if fused != gemm_fusions.DEFAULT:
                variants[f"skinny+{fused.replace(',', '+')}+pdl"] = (True, fused, True, 0, {}, {})
    return variants


def decode_step(bw: float, results: dict, context: int = 512, batch: int = 1, only: set | None = None,
                shape: str = "llama2-7b", tag: str = "") -> None:
    """One decode step of `batch` sequences of the `shape` model (graph replay): cuBLAS projections, the
    skinny kernels alone, and the skinny kernels with each set of fused neighbours
    (`hybridd/kernels/gemm_fusions.py`), other projection configs, then the default set chained
    with programmatic dependent launch where the GPU has it (`step_variants`; `only`: a
    subset of them, the plain skinny step always among them). The norm weights are
    folded into the projections for all of them (`LlamaModel.fold_norms`); the fusions
    change where products round, so each step's logits are compared with the plain
    skinny step's by relative difference and top-1."""
    from hybridd.model import KVCache, StepInputs

    defaults = pdl.ENABLED, triton_gemm.PREFETCH_COLUMNS, gemm_fusions.ENABLED, triton_gemm._TABLE
    knob_defaults = {name: getattr(_knob_module(name), name.split(".")[1]) for name in KNOBS}
    from hybridd.model.llama import LlamaModel

    cfg = step_config(shape)
    torch.manual_seed(0)
    with torch.device("cuda"), torch.no_grad():
        model = LlamaModel(cfg, "cuda", max_positions=4096, kernels="triton").to(torch.bfloat16)
        for layer in model.layers:  # norms of a trained model are not all ones
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
        model.fold_norms()  # as load_model does for the Triton kernels; every variant runs the folded weights
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor = weight_bytes / bw
    block = 16
    per_seq = context // block + 1
    kv = KVCache.allocate(cfg, batch * per_seq + 1, block, torch.bfloat16, "cuda")
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    step = StepInputs.decode([7] * batch, [context] * batch, tables, block).to("cuda")
    out = {}
    variants = step_variants(cfg, pdl.supported(torch.device("cuda")))
    if only:
        composed = {label: composed_variant(label, variants, cfg) for label in only if " with " in label}
        variants = {label: v for label, v in variants.items() if label in only or label == "skinny"} | composed
    plain = None
    try:
        for label, (skinny, fused, with_pdl, prefetch, overrides, knobs) in variants.items():
            for name, value in (knob_defaults | knobs).items():
                setattr(_knob_module(name), name.split(".")[1], value)
            triton_gemm._TABLE = defaults[3] | overrides if skinny else {}
            gemm_fusions.ENABLED = gemm_fusions.parse(fused)
            model.kernels.norms_folded = "norm" in gemm_fusions.ENABLED
            pdl.ENABLED, triton_gemm.PREFETCH_COLUMNS = with_pdl, prefetch
            with torch.no_grad():
                eager = model.forward_logits(step, kv).clone()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    logits = model.forward_logits(step, kv)
            graph.replay()
            torch.cuda.synchronize()
            agree = torch.equal(logits.argmax(-1), eager.argmax(-1))
            if plain is None or label == "skinny":
                plain = logits.clone()
            diff = ((logits - plain).norm() / plain.norm()).item()
            top1 = torch.equal(logits.argmax(-1), plain.argmax(-1))
            same = f"bit-equal {torch.equal(logits, plain)}, rel {diff:.2e}, top-1 {top1}"
            out[label] = median_gpu_time(graph.replay, 30)
            print(f"decode step b{batch} {label:32s} {out[label] * 1e3:.3f} ms ({out[label] / floor:.3f}x floor); graph and "
                  f"eager top-1 agree: {agree}; vs the plain skinny step: {same}", flush=True)
            del graph
    finally:
        pdl.ENABLED, triton_gemm.PREFETCH_COLUMNS, gemm_fusions.ENABLED, triton_gemm._TABLE = defaults
        for name, value in knob_defaults.items():
            setattr(_knob_module(name), name.split(".")[1], value)
    results[f"decode_step_{shape}_b{batch}{tag}"] = {"floor_s": floor, "weight_bytes": weight_bytes, "context": context,
                                                **out}
    print(f"\ndecode step{tag}, {shape} shape, batch {batch}, context {context}: weight floor {floor * 1e3:.3f} ms; "
          + "; ".join(f"{k} {v * 1e3:.3f} ms ({v / floor:.3f}x floor)" for k, v in out.items()), flush=True)
    del model, kv
    torch.cuda.empty_cache()


def load_decode_attention(path: Path):
    """The `decode_attention` of the module file at `path` (e.g. an earlier
    hybridd/kernels/triton_attention.py); ValueError naming the file where there is none,
    it does not load, or it has no such function."""
    if not path.is_file():
        raise ValueError(f"no file {path}")
    spec = importlib.util.spec_from_file_location("old_attention", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python module file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # whatever the file raises: it is refused, by name
        raise ValueError(f"{path} does not load: {type(exc).__name__}: {exc}") from exc
    decode_attention = getattr(module, "decode_attention", None)
    if not callable(decode_attention):
        raise ValueError(f"{path} has no decode_attention function")
    return decode_attention


def old_attention_option(text: str):
    """argparse type of an option naming an attention module file: its `decode_attention`."""
    try:
        return load_decode_attention(Path(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _batch_sizes(text: str) -> list[int]:
    """--decode-batch: a comma list of batch sizes, each at least 1."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"a comma list of batch sizes of at least 1, got {text!r}")
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description="skinny projections vs cuBLAS")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--sweep", action="store_true", help="sweep configs and print a table for triton_gemm")
    parser.add_argument("--decode-step", action="store_true", help="also time one decode step with each kernel variant")
    parser.add_argument("--decode-batch", default=[1], type=_batch_sizes,
                        help="comma list of decode step batch sizes (default 1)")
    parser.add_argument("--decode-context", default=512, type=int, help="the decode step's context length (default 512)")
    parser.add_argument("--decode-shape", default="llama2-7b", choices=STEP_SHAPES,
                        help="the decode step's model shape (default llama2-7b)")
    parser.add_argument("--variants", default="", help="comma list of decode step variants to time (default all; "
                        "the plain skinny step always runs, as the reference)")
    parser.add_argument("--old-attention", type=old_attention_option,
                        help="a module file with another decode_attention to time each decode step with too")
    parser.add_argument("--skip-compare", action="store_true")
    parser.add_argument("--shapes", default="", help="comma list of projections (e.g. 'llama2-7b o') to time "
                        "each of --configs on alone, at each of --rows")
    parser.add_argument("--configs", default=[], type=parse_configs,
                        help="comma list of block_n:block_k:split:warps:stages for --shapes")
    parser.add_argument("--rows", default=[1], type=_batch_sizes, help="row counts for --shapes (default 1)")
    parser.add_argument("--mid-rows", default=None, type=_batch_sizes,
                        help="comma list of row counts past 32: sweep one-tile configs for them against cuBLAS")
    args = parser.parse_args()
    only = set(filter(None, args.variants.split(",")))
    unknown = [s.strip() for s in args.shapes.split(",") if s.strip() and s.strip() not in SHAPES]
    if unknown:
        parser.error(f"--shapes: no projection {', '.join(unknown)}; the projections are {', '.join(SHAPES)}")
    cfg = step_config(args.decode_shape)
    known = step_variants(cfg, with_pdl=True)
    for label in only:
        if " with " in label:
            try:
                composed_variant(label, known, cfg)
            except ValueError as exc:
                parser.error(f"--variants: {exc}")
    if {label for label in only if " with " not in label} - set(known):
        parser.error(f"--variants: no variant named {', '.join(sorted(only - set(known)))}; "
                     f"the variants are {', '.join(known)}, or BASE with CHANGE ... (see composed_variant)")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    results["copy_bandwidth_Bps"] = bw = copy_bandwidth()
    print(f"device {results['device']}  copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    try:
        if args.sweep:
            table = sweep(bw, results)
            source = table_source(table)
            results["table_source"] = source
            (args.out / "gemm_table.py").write_text(source + "\n")
            print(source, flush=True)
            triton_gemm._TABLE.clear()
            triton_gemm._TABLE.update(table)
        if args.shapes:
            time_configs(bw, results, [s.strip() for s in args.shapes.split(",")], args.configs, args.rows)
        if args.mid_rows:
            sweep_mid(bw, results, args.mid_rows)
        if not args.skip_compare:
            compare(bw, results)
        if args.decode_step and args.old_attention is not None:
            from hybridd.kernels import triton_attention

            new = triton_attention.decode_attention
            try:
                for batch in args.decode_batch:
                    for round_ in (1, 2):
                        for name, attention in (("old attention", args.old_attention), ("attention now", new)):
                            # The model's kernels take the module's function when it is built.
                            triton_attention.decode_attention = attention
                            print(f"== {name}, round {round_}", flush=True)
                            decode_step(bw, results, batch=batch, only=only, shape=args.decode_shape,
                                        tag=f" {name} {round_}")
            finally:
                triton_attention.decode_attention = new
        elif args.decode_step:
            for batch in args.decode_batch:
                decode_step(bw, results, context=args.decode_context, batch=batch, only=only, shape=args.decode_shape)
    finally:
        (args.out / "bench_gemm.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
