"""The MLP of a decode step as one persistent kernel against the kernels it replaces, and
each of its phases alone.

    python scripts/bench_mlp.py --out $OUT [--rows 1,16] [--shape llama2-7b]

Per layer of MLP weights (a CUDA graph of layers back to back over weights that overflow
L2, programmatic dependent launch as the step launches them), at each row count:

- **kernels**: the step's MLP today: gate/up with its folded norm, SiLU·mul, down with the
  residual add (`triton_gemm`, `triton_ops`), and each of the three alone;
- **one kernel**: `triton_mlp.fused_mlp`, and its gate/up phase and its down phase each
  launched alone (no barrier);
- the bytes of the weights over the copy bandwidth.

With `--configs`, one kernel for each MlpConfig given too (six or seven integers each,
GATE_UP_N:GATE_UP_K:GATE_UP_STAGES:DOWN_N:DOWN_K:DOWN_STAGES[:WARPS]), and with `--per-sm`
each of them with that many programs a multiprocessor too. A form that cannot launch
(too many programs to be resident, too much shared memory) is reported and skipped.
Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_graphs import copy_bandwidth, time_calls_in_graph  # noqa: E402

SHAPES = {"llama2-7b": (4096, 11008), "llama3-8b": (4096, 14336)}
L2_OVERFLOW_BYTES = 1 << 30


def parse_rows(text: str) -> list[int]:
    try:
        rows = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rows = []
    if not rows or any(r < 1 or r > 32 for r in rows):
        raise argparse.ArgumentTypeError(f"a comma list of row counts 1-32, got {text!r}")
    return rows


def parse_per_sm(text: str) -> list[int]:
    counts = [v.strip() for v in text.split(",") if v.strip()]
    if not counts or not all(v.isdigit() and 1 <= int(v) <= 8 for v in counts):
        raise argparse.ArgumentTypeError(f"a comma list of programs a multiprocessor, 1-8, got {text!r}")
    return [int(v) for v in counts]


def parse_configs(text: str) -> list:
    from hybridd.kernels.triton_mlp import MlpConfig

    configs = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        fields = item.split(":")
        if len(fields) not in (6, 7) or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise argparse.ArgumentTypeError(
                f"a config is six or seven positive integers "
                f"GATE_UP_N:GATE_UP_K:GATE_UP_STAGES:DOWN_N:DOWN_K:DOWN_STAGES[:WARPS], got {item!r}")
        configs.append(MlpConfig(*map(int, fields)))
    return configs


class Layers:
    """Weights of enough MLP layers to overflow L2, the stream rows, their sums of squares."""

    def __init__(self, hidden: int, inter: int, rows: int):
        per_layer = 3 * hidden * inter * 2
        self.count = max(2, -(-L2_OVERFLOW_BYTES // per_layer))
        self.gate_up = [torch.randn(2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * hidden**-0.5
                        for _ in range(self.count)]
        self.down = [torch.randn(hidden, inter, dtype=torch.bfloat16, device="cuda") * inter**-0.5
                     for _ in range(self.count)]
        self.x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        self.sums = self.x.float().pow(2).reshape(rows, 64, -1).sum(-1).contiguous()
        self.bytes = per_layer


def per_sm_run(programs: int, call):
    """call() with `programs` programs a multiprocessor."""
    from hybridd.kernels import triton_mlp

    before = triton_mlp.PER_SM
    triton_mlp.PER_SM = programs
    try:
        return call()
    finally:
        triton_mlp.PER_SM = before


def forms(layers: Layers, configs: list, per_sm: list[int]) -> dict[str, list]:
    """name -> one callable per layer."""
    from hybridd.kernels import triton_gemm, triton_mlp, triton_ops
    from hybridd.kernels.triton_gemm import FoldedNorm

    norm = FoldedNorm(1e-5, layers.sums)
    x = layers.x
    gate_up = triton_gemm.skinny(x, layers.gate_up[0], None, norm=norm)
    h = triton_ops.silu_and_mul(gate_up)

    def kernels(i):
        y = triton_gemm.skinny(x, layers.gate_up[i], None, norm=norm)
        return triton_gemm.skinny(triton_ops.silu_and_mul(y), layers.down[i], None, residual=x)

    out = {
        "kernels": [lambda i=i: kernels(i) for i in range(layers.count)],
        "kernels: gate/up": [lambda i=i: triton_gemm.skinny(x, layers.gate_up[i], None, norm=norm)
                             for i in range(layers.count)],
        "kernels: SiLU·mul": [lambda: triton_ops.silu_and_mul(gate_up)],
        "kernels: down": [lambda i=i: triton_gemm.skinny(h, layers.down[i], None, residual=x)
                          for i in range(layers.count)],
    }
    for programs in [1, *per_sm]:
        for config in [None, *configs]:
            label = "one kernel" if config is None else f"one kernel {':'.join(str(v) for v in vars(config).values())}"
            label += f", {programs} a multiprocessor" if programs > 1 else ""
            for phases, suffix in ((3, ""), (1, ": gate/up phase"), (2, ": down phase")):
                out[label + suffix] = [
                    lambda i=i, p=phases, c=config, n=programs: per_sm_run(n, lambda: triton_mlp.fused_mlp(
                        x, norm, layers.gate_up[i], layers.down[i], x, c, phases=p))
                    for i in range(layers.count)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=parse_rows, default=[1], help="comma list of row counts (default 1)")
    parser.add_argument("--shape", choices=SHAPES, default="llama2-7b")
    parser.add_argument("--configs", type=parse_configs, default=[], help="more MlpConfigs to time the kernel with")
    parser.add_argument("--per-sm", type=parse_per_sm, default=[],
                        help="comma list of more programs-a-multiprocessor counts to time each config with")
    args = parser.parse_args()
    from hybridd.kernels import triton_mlp

    args.out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    hidden, inter = SHAPES[args.shape]
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "shape": args.shape,
               "copy_bandwidth_Bps": bw, "config": vars(triton_mlp.CONFIG), "rows": {}}
    print(f"device {results['device']}, copy bandwidth {bw / 1e12:.3f} TB/s, {args.shape} MLP", flush=True)
    with torch.no_grad():
        for rows in args.rows:
            layers = Layers(hidden, inter, rows)
            floor = layers.bytes / bw
            timed = {"the weights' bytes over the copy bandwidth": floor}
            for name, calls in forms(layers, args.configs, args.per_sm).items():
                try:
                    if calls[0]() is None:
                        print(f"  {name}: the kernel does not take this shape", flush=True)
                        continue
                    timed[name] = time_calls_in_graph(calls)
                except Exception as exc:  # a launch shape the GPU cannot hold: reported, the others still run
                    print(f"  {name}: cannot run: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    torch.cuda.synchronize()
            results["rows"][rows] = {name: t * 1e6 for name, t in timed.items()}
            print(f"\n{rows} row(s), µs a layer (x the MLP's bytes over the copy bandwidth):", flush=True)
            for name, t in timed.items():
                print(f"  {name:48s} {t * 1e6:8.2f}  ({t / floor:.3f})", flush=True)
            del layers
            torch.cuda.empty_cache()
    (args.out / "bench_mlp.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
