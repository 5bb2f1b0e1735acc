"""What a kernel boundary costs: a layer's reads as a chain of kernels, and as the phases
of one kernel.

    python scripts/bench_kernel_boundary.py --out $OUT

A decode step at batch 1 reads each weight once, one kernel after another, and every
kernel costs time beside its bytes (`bench_read_ramp.py`). This script reads the bytes of
one Llama-2-7B layer (by default its qkv, KV at context 512, o, gate/up and down: one
phase each) in the ways a step could be built, each timed per layer in a CUDA graph of
layers back to back over buffers that overflow L2:

- **chain**: one read kernel per phase, with programmatic dependent launch (as the
  step's kernels are launched) and without;
- **barriers**: one kernel per layer, whose programs (all resident at once) pass a grid
  barrier between phases, as a kernel that fused the layer would wait for each product
  before the next;
- **one read**: one kernel per layer without barriers, the same bytes read as one;
- **before the wait**: with dependent launch, each program's first blocks loaded before
  it waits for the kernel before (in the chain, at every phase; with barriers, at the
  layer's start), as a projection could load its first weight tiles while the kernel
  before it finishes.

Each form runs with and without early blocks: each program loads the first block of its
share of a phase before its loop over the rest, with barriers before the barrier, as a
fused layer could load the next weight (which no phase writes) while the last products
of the one before finish.

The difference between the fastest chain and the barrier forms, per boundary, estimates
what fusing a layer's kernels into one could save before its phases do any work. Every form
reads every byte once (checked against torch's sum first). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_graphs import copy_bandwidth, time_calls_in_graph  # noqa: E402
from hybridd.kernels import pdl  # noqa: E402
from hybridd.kernels.pdl import wait_for_predecessor  # noqa: E402

MIB = 1 << 20
# Llama-2-7B, batch 1: qkv, the KV cache at context 512, o, gate/up, down.
PHASES_MIB = (96, 8, 32, 172, 86)
ROTATE_BYTES = 1000 * MIB  # layers enough to be many times the H200's 50 MB L2
# (programs per multiprocessor, elements a program reads per step, warps)
SHAPES = ((2, 8192, 8), (4, 4096, 4), (8, 2048, 4))
EARLY_BLOCKS = (1,)
# A barrier that waits this many polls has programs that are not resident: the form is
# dropped rather than the GPU hung.
MAX_POLLS = 1 << 20


@triton.jit
def _phased_read_kernel(x_ptr, bounds_ptr, out_ptr, count_ptr, failed_ptr, programs,
                        PHASES: tl.constexpr, BLOCK: tl.constexpr, BARRIER: tl.constexpr, EARLY: tl.constexpr,
                        MAX_POLLS: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr = False,
                        EARLY_BEFORE_WAIT: tl.constexpr = False):
    """Program `pid` reads its contiguous share of each phase [bounds[p], bounds[p + 1]) of
    x (bounds multiples of 16 elements), phase after phase, and adds its sum to out[pid].
    With BARRIER, no program starts a phase's loads (but EARLY blocks of them) before every
    program has ended the phase before."""
    if not EARLY_BEFORE_WAIT:
        wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(PHASES):
        lo = tl.load(bounds_ptr + p)
        hi = tl.load(bounds_ptr + p + 1)
        per_program = tl.cdiv(tl.cdiv(hi - lo, programs), BLOCK) * BLOCK
        # Bounds are multiples of 16 elements (`Layers`): loads of 16 bytes, as a weight's.
        start = tl.multiple_of(lo + pid.to(tl.int64) * per_program, 16)
        end = tl.multiple_of(tl.minimum(start + per_program, hi), 16)
        early = tl.zeros([BLOCK], dtype=tl.float32)
        for b in tl.static_range(EARLY):
            idx = start + b * BLOCK + lanes
            early += tl.load(x_ptr + idx, mask=idx < end, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if EARLY_BEFORE_WAIT and p == 0:
            # The first blocks were loaded while the kernel before may still run (no kernel
            # writes them), as a projection could load its first weight tiles.
            wait_for_predecessor(PDL)
        if BARRIER and p > 0:
            # Each barrier adds `programs` to the count, so a program's ticket names its
            # barrier, and the count keeps serving across calls without a reset.
            ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            target = (ticket // programs + 1) * programs
            seen = ticket + 1
            polls = 0
            while (seen < target) & (polls < MAX_POLLS):
                seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
                polls += 1
            if seen < target:
                tl.atomic_add(failed_ptr, 1)
        acc += early
        if INTERPRET:  # the interpreter takes no loop bound loaded from memory
            off = EARLY * BLOCK
            while off < per_program:
                idx = start + off + lanes
                acc += tl.load(x_ptr + idx, mask=idx < end, other=0.0).to(tl.float32)
                off += BLOCK
        else:
            for off in tl.range(EARLY * BLOCK, per_program, BLOCK):
                idx = start + off + lanes
                acc += tl.load(x_ptr + idx, mask=idx < end, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.atomic_add(out_ptr + pid, tl.sum(acc, axis=0))


class Layers:
    """Buffers of `layers` layers, each its phases' bytes back to back, and per phase the
    bounds of its elements."""

    def __init__(self, phases_mib: list[int], layers: int, device: str):
        sizes = [mib * MIB // 2 for mib in phases_mib]  # multiples of 16 elements, as the kernel needs
        edges = [0]
        for n in sizes:
            edges.append(edges[-1] + n)
        self.buffers = [torch.randn(edges[-1], dtype=torch.bfloat16, device=device) for _ in range(layers)]
        self.bounds = torch.tensor(edges, dtype=torch.int64, device=device)
        self.phase_bounds = [torch.tensor([lo, hi], dtype=torch.int64, device=device)
                             for lo, hi in zip(edges, edges[1:])]
        self.phases = len(sizes)
        self.nbytes = edges[-1] * 2


class Form:
    """One way to read a layer: `call(...)` gives a function that launches one layer's reads."""

    def __init__(self, name: str, per_sm: int, block: int, warps: int, chain: bool, barrier: bool, early: int,
                 with_pdl: bool, before_wait: bool = False):
        self.name, self.per_sm, self.block, self.warps = name, per_sm, block, warps
        self.chain, self.barrier, self.early, self.with_pdl = chain, barrier, early, with_pdl
        self.before_wait = before_wait

    @property
    def label(self) -> str:
        return f"{self.name} ({self.per_sm}x{self.block}x{self.warps})"

    def call(self, layers: Layers, x: torch.Tensor, out: torch.Tensor, count: torch.Tensor, failed: torch.Tensor,
             programs: int):
        launch = pdl.launch_args(x.device) if self.with_pdl else {"PDL": False}
        common = dict(BLOCK=self.block, EARLY=self.early, EARLY_BEFORE_WAIT=self.before_wait, MAX_POLLS=MAX_POLLS,
                      num_warps=self.warps, num_stages=3, **launch)
        if self.chain:
            def call():
                for bounds in layers.phase_bounds:
                    _phased_read_kernel[(programs,)](x, bounds, out, count, failed, programs, PHASES=1,
                                                     BARRIER=False, **common)
        else:
            def call():
                _phased_read_kernel[(programs,)](x, layers.bounds, out, count, failed, programs,
                                                 PHASES=layers.phases, BARRIER=self.barrier, **common)
        return call


def forms(shapes, early_blocks) -> list[Form]:
    """Every form at every launch shape."""
    out = []
    for per_sm, block, warps in shapes:
        for early in (0, *early_blocks):
            # A program's first blocks of a phase loaded before the loop over the rest (and
            # before the barrier), in every form, so that each form is timed with and without.
            blocks = f", {early} early block{'s' if early > 1 else ''}" if early else ""
            out += [
                Form(f"chain, PDL{blocks}", per_sm, block, warps, chain=True, barrier=False, early=early,
                     with_pdl=True),
                Form(f"chain{blocks}", per_sm, block, warps, chain=True, barrier=False, early=early, with_pdl=False),
                Form(f"barriers{blocks}", per_sm, block, warps, chain=False, barrier=True, early=early,
                     with_pdl=True),
                Form(f"one read{blocks}", per_sm, block, warps, chain=False, barrier=False, early=early,
                     with_pdl=True),
            ]
            if early:
                out += [Form(f"{form}{blocks} before the wait", per_sm, block, warps, chain=form.startswith("chain"),
                             barrier=form == "barriers", early=early, with_pdl=True, before_wait=True)
                        for form in ("chain, PDL", "barriers")]
    return out


def resident_per_sm(kernel, warps: int, props) -> int:
    """How many programs of a compiled kernel one multiprocessor holds at once."""
    by_warps = props.max_threads_per_multi_processor // (32 * warps)
    by_regs = props.regs_per_multiprocessor // max(1, kernel.n_regs * 32 * warps)
    shared = kernel.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // shared if shared else by_warps
    return min(by_warps, by_regs, by_smem)


class BarrierGaveUp(RuntimeError):
    """A barrier waited MAX_POLLS polls: not every program of the grid was resident."""


def check_sum(form: Form, layers: Layers, out: torch.Tensor, count: torch.Tensor, failed: torch.Tensor,
              programs: int) -> None:
    """Run the form over the first layer once; its programs' sums must add up to torch's."""
    x = layers.buffers[0]
    out.zero_()
    form.call(layers, x, out, count, failed, programs)()
    torch.cuda.synchronize()
    if failed.item():
        raise BarrierGaveUp(f"{form.label}: a barrier gave up waiting (programs not all resident)")
    want = x.float().sum().item()
    got = out.sum().item()
    if abs(got - want) > 1e-3 * x.float().abs().sum().item():
        raise SystemExit(f"{form.label}: the programs summed {got} for {want}")


def parse_phases(text: str) -> list[int]:
    phases = [int(v) for v in text.split(",")]
    if len(phases) < 2 or min(phases) < 1:
        raise ValueError
    return phases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--phases-mib", default=",".join(map(str, PHASES_MIB)),
                        help="comma list of a layer's reads in MiB, two or more (default %(default)s)")
    args = parser.parse_args()
    try:
        phases_mib = parse_phases(args.phases_mib)
    except ValueError:
        parser.error(f"--phases-mib: a comma list of two or more sizes of at least 1 MiB, got {args.phases_mib!r}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    bw = copy_bandwidth()
    layer_bytes = sum(phases_mib) * MIB
    layers = Layers(phases_mib, max(2, -(-ROTATE_BYTES // layer_bytes)), "cuda")
    floor_s = layers.nbytes / bw
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_Bps": bw,
               "multiprocessors": sms, "pdl": pdl.supported(torch.device("cuda")), "phases_mib": phases_mib,
               "layers_rotated": len(layers.buffers), "layer_floor_s": floor_s, "forms": []}
    print(f"device {results['device']}  copy bandwidth {bw / 1e12:.3f} TB/s  {sms} multiprocessors  "
          f"layer of {'+'.join(map(str, phases_mib))} MiB, its read at the copy bandwidth {floor_s * 1e6:.2f} us",
          flush=True)
    out = torch.zeros(max(s[0] for s in SHAPES) * sms, dtype=torch.float32, device="cuda")
    failed = torch.zeros(1, dtype=torch.int32, device="cuda")
    boundaries = len(phases_mib) - 1
    for form in forms(SHAPES, EARLY_BLOCKS):
        programs = form.per_sm * sms
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        row = {"form": form.name, "shape": f"{form.per_sm}x{form.block}x{form.warps}"}
        if form.barrier:
            # Compiled on one program (its barriers pass at once) to learn its residency.
            kernel = _phased_read_kernel[(1,)](
                layers.buffers[0], layers.bounds, out, count, failed, 1, PHASES=layers.phases, BARRIER=True,
                BLOCK=form.block, EARLY=form.early, EARLY_BEFORE_WAIT=form.before_wait, MAX_POLLS=MAX_POLLS,
                num_warps=form.warps, num_stages=3, **pdl.launch_args(out.device))
            torch.cuda.synchronize()
            count.zero_()  # the count must start at a multiple of the timed grid's programs
            if resident_per_sm(kernel, form.warps, props) < form.per_sm:
                row["skipped"] = f"only {resident_per_sm(kernel, form.warps, props)} programs a multiprocessor resident"
                results["forms"].append(row)
                print(f"{form.label:48s} skipped: {row['skipped']}", flush=True)
                continue
        try:
            check_sum(form, layers, out, count, failed, programs)
        except BarrierGaveUp:
            # More programs than the GPU holds at once, where the registers' count said they fit.
            failed.zero_()
            row["skipped"] = "a barrier gave up waiting: programs not all resident"
            results["forms"].append(row)
            print(f"{form.label:48s} skipped: {row['skipped']}", flush=True)
            continue
        seconds = time_calls_in_graph([form.call(layers, x, out, count, failed, programs) for x in layers.buffers])
        if failed.item():
            raise SystemExit(f"{form.label}: a barrier gave up waiting while timed")
        row.update({"s_per_layer": seconds, "of_floor": seconds / floor_s})
        results["forms"].append(row)
        print(f"{form.label:48s} {seconds * 1e6:9.2f} us a layer  x{seconds / floor_s:.3f} of its read time",
              flush=True)
    best = {}
    for row in results["forms"]:
        if "s_per_layer" in row and row["s_per_layer"] < best.get(row["form"], {}).get("s_per_layer", float("inf")):
            best[row["form"]] = row
    results["best"] = best
    chain = min((row for name, row in best.items() if name.startswith("chain")), default=None,
                key=lambda row: row["s_per_layer"])
    print(f"\nbest launch shape of each form, per layer ({boundaries} boundaries between its "
          f"{len(phases_mib)} phases):")
    for name, row in best.items():
        saved = "" if chain is None or name.startswith("chain") else (
            f"   {(chain['s_per_layer'] - row['s_per_layer']) / boundaries * 1e6:+.2f} us a boundary against the "
            f"fastest chain ({chain['form']})")
        print(f"  {name:32s} {row['s_per_layer'] * 1e6:9.2f} us ({row['shape']}){saved}")
    (args.out / "bench_kernel_boundary.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
