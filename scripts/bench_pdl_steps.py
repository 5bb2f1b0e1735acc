"""Graph steps under the code's policies and others, side by side (CUDA): launched with
programmatic dependent launch throughout, or with the prefill's projections on PyTorch's
cuBLAS call alone.

    python scripts/bench_pdl_steps.py --out $OUT [--policies code,pdl_throughout]

Builds the Llama-2-7B shape with random weights (or `--model DIR`) and, for each policy
in turn (two rounds, alternated), captures the decode graphs of batch 1 and 32 and the
prefill graphs of 16-512 tokens in a fresh graph runner, then times each step: back to
back (ten replays between two CUDA events, the median of ten rounds) and from an idle
GPU (one replay, the median of 40). The policies:

- `code`: the default (`pdl.CUBLAS_STEPS = False`): a step whose projections run on
  cuBLAS (more token rows than the skinny projections take) launches its Triton
  kernels without PDL, every other step with it;
- `pdl_throughout`: every step's Triton kernels with PDL (`pdl.CUBLAS_STEPS = True`);
- `cublas_prefill`: the prefill's projections on PyTorch's cuBLAS call, none on the
  cuBLASLt algorithms of `prefill_gemm`'s table (`prefill_gemm.ENABLED = False`).

A policy may be followed by ` with KNOB=VALUE ...`, each KNOB a launch constant of the
Triton kernels outside the projections (`ops.ROTARY_SPLITS`, `ops.ROTARY_WARPS`,
`ops.SILU_LAUNCH`, `ops.SILU_NORM_LAUNCH`; a pair written `4096:8`), set for that policy's
graphs alone: `--policies "code,code with ops.ROTARY_SPLITS=4"`; or `table=PATH`, the
cuBLASLt entries `bench_cublaslt.py --table-out PATH` wrote, taking the place of the
code's entries for the same products in that policy's graphs:
`--policies "code,code with table=winners.json"`. `--prefill` picks the
prefill lengths (default 16-512).

Prints a table and writes `pdl_steps.json` under `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_cublaslt import count_from, read_table  # noqa: E402
from bench_graphs import BLOCK, captured_runner, decode_step, median_gpu_time, prefill_step, stepper  # noqa: E402
from make_random_checkpoint import describe, make_checkpoint  # noqa: E402

from hybridd.model import load_model
from hybridd.kernels import pdl, prefill_gemm, triton_ops  # noqa: E402

CONTEXT = 512
DECODE_BATCHES = (1, 32)
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512)
# policy -> (pdl.CUBLAS_STEPS, prefill_gemm.ENABLED)
POLICIES = {"code": (False, True), "pdl_throughout": (True, True), "cublas_prefill": (False, False)}
# Launch constants a policy may set, as `ops.NAME`.
KNOBS = {"ops.ROTARY_SPLITS": int, "ops.ROTARY_WARPS": int, "ops.SILU_LAUNCH": tuple, "ops.SILU_NORM_LAUNCH": tuple}
# A policy's cuBLASLt entries over the code's `prefill_gemm._TABLE`: `table=PATH`.
TABLE_KNOB = "table"


def parse_policy(label: str) -> tuple[str, dict[str, object]]:
    """`POLICY [with KNOB=VALUE ...]` -> (policy, {knob: value}); ValueError naming what is wrong."""
    base, _, changes = label.partition(" with ")
    base = base.strip()
    if base not in POLICIES:
        raise ValueError(f"no policy {base!r} in {label!r} (policies: {', '.join(POLICIES)})")
    knobs: dict[str, object] = {}
    for change in changes.split():
        name, eq, value = change.partition("=")
        if name == TABLE_KNOB and eq:
            knobs[name] = read_table(Path(value))
            continue
        if name not in KNOBS or not eq:
            raise ValueError(f"{change!r} in {label!r}: want KNOB=VALUE, KNOB one of "
                             f"{', '.join([*KNOBS, TABLE_KNOB])}")
        try:
            parts = tuple(int(v) for v in value.split(":"))
        except ValueError:
            raise ValueError(f"{change!r} in {label!r}: the value must be an integer or integers joined by ':'") from None
        if (KNOBS[name] is int) != (len(parts) == 1):
            raise ValueError(f"{change!r} in {label!r}: {name} takes {'one integer' if KNOBS[name] is int else 'a pair a:b'}")
        knobs[name] = parts[0] if KNOBS[name] is int else parts
    return base, knobs


def gpu_times(stream: torch.cuda.Stream, run) -> tuple[float, float]:
    """(back to back, from idle) median seconds per step of `run` on `stream`."""
    for _ in range(5):
        run()
    stream.synchronize()
    return (median_gpu_time(run, 10, stream, per_round=10),
            median_gpu_time(run, 40, stream, idle_s=0.003))


def measure(model, label: str, prefill_tokens: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Each step's times under one policy, with graphs captured under it."""
    with policy_settings(label):
        return _timed_steps(model, prefill_tokens)


@contextlib.contextmanager
def policy_settings(label: str):
    """The policy `label` names in force (its PDL and table settings, its knobs), and the
    code's own again afterwards."""
    policy, knobs = parse_policy(label)
    code_policy = pdl.CUBLAS_STEPS, prefill_gemm.ENABLED
    pdl.CUBLAS_STEPS, prefill_gemm.ENABLED = POLICIES[policy]
    table = knobs.pop(TABLE_KNOB, None)
    code_table = prefill_gemm._TABLE
    defaults = {name: getattr(triton_ops, _constant(name)) for name in knobs}
    try:
        for name, value in knobs.items():
            setattr(triton_ops, _constant(name), value)
        if table is not None:
            prefill_gemm._TABLE = code_table | table
            prefill_gemm._resolve.cache_clear()
        yield
    finally:  # the next policy's graphs are captured with the code's settings unless it sets its own
        for name, value in defaults.items():
            setattr(triton_ops, _constant(name), value)
        prefill_gemm._TABLE = code_table
        prefill_gemm._resolve.cache_clear()
        pdl.CUBLAS_STEPS, prefill_gemm.ENABLED = code_policy


def _constant(knob: str) -> str:
    """The name in `triton_ops` of knob `ops.NAME`."""
    return knob.removeprefix("ops.")


def _timed_steps(model, prefill_tokens: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Each step's times, with graphs captured under the settings in force."""
    width = (CONTEXT + max(prefill_tokens)) // BLOCK + 1
    runner = captured_runner(model, DECODE_BATCHES, prefill_tokens, width, timeout_s=300)
    missing = [tokens for tokens in prefill_tokens if not runner.stats[("prefill", tokens)].captured]
    if missing:
        raise RuntimeError(f"prefill graphs of {missing} tokens were not captured")
    tables = [list(range(i * width, (i + 1) * width)) for i in range(max(DECODE_BATCHES))]
    steps = {f"decode_b{b}": decode_step(b, CONTEXT, tables[:b]) for b in DECODE_BATCHES}
    steps |= {f"prefill_{n}": prefill_step(n, tables[0]) for n in prefill_tokens}
    out = {}
    for name, step in steps.items():
        run = stepper(runner, step)
        if not runner.plan_step(step.is_prefill, step.num_tokens, step.num_seqs).graph:
            raise RuntimeError(f"{name} did not run as a graph")
        b2b, idle = gpu_times(runner.stream, run)
        out[name] = {"back_to_back_s": b2b, "from_idle_s": idle}
    del runner, run
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _policies(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must name some of {', '.join(POLICIES)}, got {value!r}")
    for name in names:
        try:
            parse_policy(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _prefill(value: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated token counts, got {value!r}") from None
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be at least 1, got {value!r}")
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="local HF model directory (default: random Llama-2-7B shape)")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--rounds", type=count_from(1), default=2, help="rounds of the policies (default 2)")
    parser.add_argument("--policies", type=_policies, default=["code", "pdl_throughout"],
                        help=f"comma list of {', '.join(POLICIES)}, each maybe 'with KNOB=VALUE ...' (default code,pdl_throughout)")
    parser.add_argument("--prefill", type=_prefill, default=PREFILL_TOKENS, help="prefill lengths (default 16-512)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl_steps.py needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model
    if model_dir is None:
        model_dir = make_checkpoint(Path("/tmp/hybridd-llama2-7b-normal-random"), "llama2-7b")
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda", max_positions=2048)
    runs = []
    default = pdl.CUBLAS_STEPS, prefill_gemm.ENABLED
    try:
        for _ in range(args.rounds):
            for policy in args.policies:
                runs.append({"policy": policy, "steps": measure(model, policy, args.prefill)})
    finally:
        pdl.CUBLAS_STEPS, prefill_gemm.ENABLED = default
    model_name = describe(model_dir)
    (args.out / "pdl_steps.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "model": model_name,
                                                         "runs": runs}, indent=1))
    names = list(runs[0]["steps"])
    print(f"{torch.cuda.get_device_name()}, {model_name}, context {CONTEXT} for decode; ms per step, "
          f"back to back / from an idle GPU, each round's policies in the order given")
    for i, r in enumerate(runs, 1):
        print(f"  [{i}] {r['policy']}")
    print(f"{'step':12s}" + "".join(f" | {f'[{i}]':>21s}" for i in range(1, len(runs) + 1)))
    for name in names:
        print(f"{name:12s}" + "".join(f" | {r['steps'][name]['back_to_back_s'] * 1e3:9.3f} / "
                                      f"{r['steps'][name]['from_idle_s'] * 1e3:9.3f}" for r in runs))


if __name__ == "__main__":
    main()
