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

Prints a table and writes `pdl_steps.json` under `--out`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_graphs import BLOCK, captured_runner, decode_step, median_gpu_time, prefill_step, stepper  # noqa: E402

from hybridd.model import load_model, pdl, prefill_gemm  # noqa: E402

CONTEXT = 512
DECODE_BATCHES = (1, 32)
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512)
# policy -> (pdl.CUBLAS_STEPS, prefill_gemm.ENABLED)
POLICIES = {"code": (False, True), "pdl_throughout": (True, True), "cublas_prefill": (False, False)}


def gpu_times(stream: torch.cuda.Stream, run) -> tuple[float, float]:
    """(back to back, from idle) median seconds per step of `run` on `stream`."""
    for _ in range(5):
        run()
    stream.synchronize()
    return (median_gpu_time(run, 10, stream, per_round=10),
            median_gpu_time(run, 40, stream, idle_s=0.003))


def measure(model, policy: str) -> dict[str, dict[str, float]]:
    """Each step's times under one policy, with graphs captured under it."""
    pdl.CUBLAS_STEPS, prefill_gemm.ENABLED = POLICIES[policy]
    width = (CONTEXT + max(PREFILL_TOKENS)) // BLOCK + 1
    runner = captured_runner(model, DECODE_BATCHES, PREFILL_TOKENS, width, timeout_s=300)
    missing = [tokens for tokens in PREFILL_TOKENS if not runner.stats[("prefill", tokens)].captured]
    if missing:
        raise RuntimeError(f"prefill graphs of {missing} tokens were not captured")
    tables = [list(range(i * width, (i + 1) * width)) for i in range(max(DECODE_BATCHES))]
    steps = {f"decode_b{b}": decode_step(b, CONTEXT, tables[:b]) for b in DECODE_BATCHES}
    steps |= {f"prefill_{n}": prefill_step(n, tables[0]) for n in PREFILL_TOKENS}
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


def _rounds(value: str) -> int:
    rounds = int(value)
    if rounds < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {rounds}")
    return rounds


def _policies(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"must name some of {', '.join(POLICIES)}, got {value!r}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="local HF model directory (default: random Llama-2-7B shape)")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--rounds", type=_rounds, default=2, help="rounds of the policies (default 2)")
    parser.add_argument("--policies", type=_policies, default=["code", "pdl_throughout"],
                        help=f"comma list of {', '.join(POLICIES)} (default code,pdl_throughout)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl_steps.py needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model
    if model_dir is None:
        from make_random_checkpoint import make_checkpoint

        model_dir = make_checkpoint(Path("/tmp/hybridd-llama2-7b-normal-random"), "llama2-7b")
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda", max_positions=2048)
    runs = []
    default = pdl.CUBLAS_STEPS, prefill_gemm.ENABLED
    try:
        for _ in range(args.rounds):
            for policy in args.policies:
                runs.append({"policy": policy, "steps": measure(model, policy)})
    finally:
        pdl.CUBLAS_STEPS, prefill_gemm.ENABLED = default
    (args.out / "pdl_steps.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "runs": runs}, indent=1))
    names = list(runs[0]["steps"])
    print(f"{torch.cuda.get_device_name()}, Llama-2-7B shape, context {CONTEXT} for decode; ms per step, "
          f"back to back / from an idle GPU, each round's policies in the order given")
    print(f"{'step':12s}" + "".join(f" | {r['policy']:>21s}" for r in runs))
    for name in names:
        print(f"{name:12s}" + "".join(f" | {r['steps'][name]['back_to_back_s'] * 1e3:9.3f} / "
                                      f"{r['steps'][name]['from_idle_s'] * 1e3:9.3f}" for r in runs))


if __name__ == "__main__":
    main()
