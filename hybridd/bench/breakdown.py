"""Where one step's time goes: its kernels by category, each against its own floor.

    python -m hybridd.bench.breakdown --model DIR [--device cuda] [--out breakdown.json]
    python -m hybridd.bench.breakdown --trace DIR/trace-graph-*.json --layers 32 --steps 8

The bench's `breakdown` part. The decode graphs for batch 1 and 32 (512 tokens of
context) and the 16- and 128-token prefill graphs are captured as the daemon captures
them and replayed under the PyTorch profiler; each kernel is put in a category by its
name (CATEGORY_RULES: GEMM by projection, attention, norm, RoPE/KV write, other) and
each category is set against its floor (its bytes over the copy bandwidth or its FLOPs
over the matmul rate); `gaps` is the step's GPU time, steps back to back, minus its
kernels. On the CPU the eager step's top-level operators stand in for kernels.
`--trace` summarizes a kernel trace the daemon wrote (hybridd/runtime/step_trace.py)
or any profiler trace instead: its kernels by category, no floors.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from hybridd import environment
from hybridd.bench.timing import (BLOCK, captured_runner, decode_step, device_ceilings, median_time, prefill_step,
                                  stepper)

CONTEXT = 512
DECODE_BATCHES = (1, 32)
PREFILL_SIZES = (16, 128)
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # in the order a decoder layer runs them
STEP_RANGE = "bench.breakdown.step"

# Kernel name -> category, first match wins (case-insensitive search). Add a row for a new
# kernel; a name no row matches is counted in "other" and listed under `unlisted_kernels`.
# Attention comes before GEMM: fused attention kernels are often built from cutlass.
CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    ("attention", r"attention|attn|flash|fmha|^_?(decode|prefill)(_split|_merge)?_kernel|paged|sdpa"
                  r"|scaled_dot_product|softmax|^aten::einsum"),
    # The separate reduction of a split-K GEMM (cuBLAS splitKreduce_kernel): part of the GEMM before it.
    # A main GEMM kernel may carry "splitK" in its name too, so the rule needs "reduce".
    ("gemm_reduce", r"split_?k_?reduce|reduce_?split_?k"),
    ("rope_kv", r"rotary|rope|write_kv|kv_write|reshape_and_cache|store_kv|cache_write"),
    ("norm", r"rms_?norm|layer_?norm|_norm_kernel"),
    ("gemm", r"gemm|gemv|matmul|nvjet|cutlass|cublas|xmma|skinny|_linear|^aten::(linear|mm|addmm)$"),
    ("other", r"quantize|silu|swiglu|act_and_mul|gelu|embedding|index_select|indexselect|gather|memcpy|memset|fill"
              r"|elementwise|copy|cast|argmax|arange|^aten::(mul|add|cat|to|_to_copy|copy_|index_select|view"
              r"|reshape|split|empty|zeros|float|select|slice|t|transpose|contiguous)$"),
)
_RULES = tuple((category, re.compile(pattern, re.IGNORECASE)) for category, pattern in CATEGORY_RULES)
NO_FLOOR = {"floor_bytes": 0.0, "floor_flops": 0.0, "floor_s": 0.0}
CATEGORY_ORDER = ("gemm.qkv", "gemm.o", "gemm.gate_up", "gemm.down", "gemm.lm_head", "gemm", "attention", "norm",
                  "rope_kv", "other", "gaps")


def classify(name: str) -> str | None:
    """The category of a kernel (or CPU operator) name; None when no rule names it."""
    for category, pattern in _RULES:
        if pattern.search(name):
            return category
    return None


def attribute(names: list[str], num_layers: int) -> tuple[list[str], str | None]:
    """Each kernel's category in one step's launch order, GEMMs by projection.

    A decoder layer runs its four projections in a fixed order and the LM head comes
    last, so the k-th GEMM of a step with 4·layers + 1 of them is known by its position
    (a split-K reduce kernel belongs to the GEMM before it). With any other count the
    GEMMs stay unattributed (category `gemm`) and the note says why."""
    raw = [classify(n) for n in names]
    mains = sum(1 for c in raw if c == "gemm")
    expected = 4 * num_layers + 1
    note = None
    if mains != expected:
        note = f"{mains} GEMM kernels per step, not 4 x {num_layers} layers + 1: GEMMs not attributed to projections"
    out, index = [], -1
    for category in raw:
        if category in ("gemm", "gemm_reduce"):
            if category == "gemm":
                index += 1
            if note is not None or index < 0:
                out.append("gemm")
            else:
                out.append("gemm.lm_head" if index == expected - 1 else f"gemm.{PROJECTIONS[index % 4]}")
        else:
            out.append(category or "other")
    return out, note


def step_floors(config, tokens: int, seqs: int, context: int, prefill: bool, elem: int, bw: float,
                flops: float, weight_elem: int | None = None) -> dict[str, dict]:
    """Bytes each category must move (read + written) and its floor in seconds; the
    decoder's projection weights at `weight_elem` bytes an element (FP8: 1; default
    `elem`), the activations, the LM head and the caches at `elem`."""
    weight_elem = elem if weight_elem is None else weight_elem
    h, q, kv, inter, vocab, layers = (config.hidden_size, config.q_size, config.kv_size, config.intermediate_size,
                                      config.vocab_size, config.num_layers)

    def entry(nbytes: float, flop: float = 0.0) -> dict:
        return {"floor_bytes": nbytes, "floor_flops": flop, "floor_s": max(nbytes / bw, flop / flops)}

    out = {}
    for name, (k, n) in zip(PROJECTIONS, ((h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h))):
        out[f"gemm.{name}"] = entry(layers * (k * n * weight_elem + tokens * (k + n) * elem),
                                    layers * 2.0 * tokens * k * n)
    out["gemm.lm_head"] = entry(h * vocab * elem + seqs * h * elem + seqs * vocab * elem, 2.0 * seqs * h * vocab)
    if prefill:  # each token attends to the step's own tokens (causal): K/V of the step, read once
        attn_bytes = layers * tokens * (2 * q + 2 * kv) * elem
        attn_flops = layers * 2.0 * 2 * q * tokens * (tokens + 1) / 2
    else:  # every sequence reads its whole context's K and V
        attn_bytes = layers * (seqs * context * 2 * kv + tokens * 2 * q) * elem
        attn_flops = layers * 2.0 * 2 * q * seqs * context
    out["attention"] = entry(attn_bytes, attn_flops)
    # First norm reads x and writes it; each add+norm reads x and the residual and writes both.
    out["norm"] = entry((2 * layers + 1) * (4 * tokens * h + h) * elem)
    # RoPE reads and writes q and k; the KV write reads k and v and writes them to the cache.
    out["rope_kv"] = entry(layers * tokens * (2 * (q + kv) + 2 * 2 * kv) * elem)
    # SiLU*mul reads 2I and writes I per token; the embedding row; the logits' float copy.
    out["other"] = entry(layers * tokens * 3 * inter * elem + 2 * tokens * h * elem + seqs * vocab * (elem + 4))
    out["gaps"] = entry(0.0)
    return out


def summarize(steps: list[list[tuple[str, float]]], num_layers: int, step_s: float, floors: dict,
              num_steps: int | None = None) -> dict:
    """Per-category time per step from the kernels of `steps` (each a list of (name,
    seconds) in launch order, or one list holding `num_steps` steps' kernels when they
    could not be split), with each category's floor and its ratio."""
    n = num_steps or len(steps)
    if len(steps) != n and len(steps) != 1:
        raise ValueError(f"{len(steps)} kernel lists for {n} steps")
    lengths = {len(s) for s in steps}
    notes = []
    if len(steps) != n:
        notes.append(f"{len(steps[0])} kernels over {n} steps do not split evenly: GEMMs not attributed to projections")
        labels = None
    elif len(lengths) == 1:
        labels, note = attribute([name for name, _ in steps[0]], num_layers)
        if note:
            notes.append(note)
    else:  # steps differ: no positions to go by
        notes.append(f"kernels per step differ across steps ({sorted(lengths)}): GEMMs not attributed to projections")
        labels = None
    per_cat: dict[str, dict] = {}
    unlisted: dict[str, dict] = {}
    by_name: dict[str, dict] = {}

    def charge(table: dict, key: str, seconds: float, count: str, **fields) -> None:
        entry = table.setdefault(key, {**fields, count: 0, "time_s": 0.0})
        entry[count] += 1
        entry["time_s"] += seconds / n

    for kernels in steps:
        step_labels = labels if labels is not None else attribute([k for k, _ in kernels], -1)[0]
        for (name, seconds), category in zip(kernels, step_labels):
            charge(per_cat, category, seconds, "kernels")
            charge(by_name, name, seconds, "count", name=name, category=category)
            if classify(name) is None:
                charge(unlisted, name, seconds, "count", name=name)
    kernel_s = sum(c["time_s"] for c in per_cat.values())
    per_cat["gaps"] = {"time_s": max(0.0, step_s - kernel_s), "kernels": 0}
    categories = {}
    for name in CATEGORY_ORDER:
        if name not in per_cat and name == "gemm":
            continue
        c = per_cat.get(name, {"time_s": 0.0, "kernels": 0})
        fl = floors.get(name) or NO_FLOOR
        if name == "gemm":  # unattributed: the floor of all projections together
            fl = {key: sum(floors.get(f"gemm.{p}", NO_FLOOR)[key] for p in (*PROJECTIONS, "lm_head"))
                  for key in ("floor_bytes", "floor_flops", "floor_s")}
        categories[name] = {"time_s": c["time_s"], "kernels_per_step": c["kernels"] / n, **fl,
                            "x_floor": c["time_s"] / fl["floor_s"] if fl["floor_s"] else None}
    if "gemm" in categories:
        for p in (*PROJECTIONS, "lm_head"):
            categories.pop(f"gemm.{p}", None)
    floor_s = sum(c["floor_s"] for c in categories.values())
    for kernel in by_name.values():
        kernel["count"] /= n
    return {
        "step_s": step_s, "kernel_s": kernel_s, "kernels_per_step": sum(len(s) for s in steps) / n,
        "floor_s": floor_s, "x_floor": step_s / floor_s if floor_s else None, "categories": categories,
        "top_kernels": sorted(by_name.values(), key=lambda k: -k["time_s"])[:12],
        "unlisted_kernels": sorted(unlisted.values(), key=lambda k: -k["time_s"]),
        "steps_profiled": n, "notes": notes,
    }


# ----------------------------------------------------------------------------- profiling


def exclusive_times(intervals: list[tuple[float, float, str]]) -> list[tuple[str, float]]:
    """(kernel name, seconds) for kernel intervals (start µs, end µs, "worker:name") in
    start order: the time by which each kernel extends the GPU's busy time. Kernels
    launched with PDL start before their predecessor ends and wait for it, so their own
    durations overlap and would count that wait twice; a kernel that starts after the
    previous one ended gets its whole duration, as without PDL."""
    out = []
    busy_until = float("-inf")
    for start, end, name in intervals:
        out.append((name.split(":", 1)[1], max(0.0, end - max(start, busy_until)) / 1e6))
        busy_until = max(busy_until, end)
    return out


def kernel_intervals(path: Path) -> list[tuple[float, float, str]]:
    """(start µs, end µs, "worker:kernel") of every kernel, copy and memset in a profiler trace."""
    trace = json.loads(path.read_text())
    base_us = trace.get("baseTimeNanoseconds", 0) / 1000.0
    worker = path.stem.split("-")[1] if path.stem.count("-") >= 2 else path.stem
    out = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            start = base_us + float(event["ts"])
            out.append((start, start + float(event.get("dur", 0)), f"{worker}:{event.get('name', '?')}"))
    return out


def profile_steps(run, sync, steps: int, cuda: bool) -> list[list[tuple[str, float]]]:
    """The kernels (CUDA) or top-level operators (CPU) of `steps` calls of `run`, per step,
    in launch order, as (name, seconds)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                run()
            sync()
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace-breakdown-0.json"
            prof.export_chrome_trace(str(path))
            intervals = sorted(kernel_intervals(path))
        kernels = exclusive_times(intervals)
        if not kernels or len(kernels) % steps:
            return [kernels] if kernels else []  # one list: positions are not comparable across steps
        per = len(kernels) // steps
        return [kernels[i * per:(i + 1) * per] for i in range(steps)]
    out = []
    for event in prof.events():
        if event.name == STEP_RANGE:
            out.append([])
    index = -1
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if event.name == STEP_RANGE:
            index += 1
        elif event.cpu_parent is not None and event.cpu_parent.name == STEP_RANGE and index >= 0:
            out[index].append((event.name, event.time_range.elapsed_us() / 1e6))
    return out


def run_breakdown(model_dir: Path, device: str, ceilings: dict, steps: int = 20, quantization: str = "none") -> dict:
    """Capture the graphs, then profile decode batch 1 and 32 (context 512) and the
    16- and 128-token prefills; one summary per step kind. `quantization` "fp8": the
    model quantized at load, its floors on the FP8 bytes."""
    import torch

    from hybridd.model import load_model
    from hybridd.runtime.graph_runner import GraphRunner

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    max_positions = 1024
    model = load_model(model_dir, dtype=dtype, device=device, max_positions=max_positions, quantization=quantization)
    config = model.config
    elem = torch.finfo(dtype).bits // 8
    weight_elem = 1 if model.quantization is not None else elem
    width = max_positions // BLOCK
    batch = max(DECODE_BATCHES)
    runner = captured_runner(model, DECODE_BATCHES, PREFILL_SIZES, width)
    kv, buffers, plan = runner.kv_cache, runner.buffers, runner.plan
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
    sync = runner.stream.synchronize if cuda else (lambda: None)
    bw, flops = ceilings["copy_bandwidth_Bps"], ceilings["matmul_flops"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cases = [(f"decode_b{b}", decode_step(b, CONTEXT, tables[:b]), b, b, CONTEXT, False) for b in DECODE_BATCHES]
    cases += [(f"prefill_{n}", prefill_step(n, tables[0]), n, 1, 0, True) for n in PREFILL_SIZES]
    from hybridd.kernels import pdl

    # Kernel times are charged exclusively (`exclusive_times`), so that PDL's overlap is
    # not counted twice; earlier outputs without "attribution" summed whole durations.
    out: dict = {"device": device, "dtype": str(dtype).removeprefix("torch."), "quantization": quantization,
                 "block_size": BLOCK,
                 "weight_bytes": weight_bytes, "rules": [list(r) for r in CATEGORY_RULES],
                 "pdl": pdl.enabled(torch.device(device)), "attribution": "exclusive"}
    for key, step, tokens, seqs, context, prefill in cases:
        run = stepper(runner, step)
        for _ in range(5 if cuda else 1):
            run()
        sync()
        # Steps back to back (each launch overlapping the step before), and one from an idle GPU.
        step_s = median_time(run, 10 if cuda else 1, cuda, runner.stream, per_round=10 if cuda else 3)
        from_idle_s = median_time(run, 50 if cuda else 3, cuda, runner.stream)
        shape = runner.plan_step(prefill, tokens, seqs)
        kernels = profile_steps(run, sync, steps, cuda)
        source = "graph replays" if shape.graph and cuda else ("eager steps" if not cuda else "eager (no graph)")
        if cuda and kernels and len(kernels[0]) < 4 * config.num_layers:
            # The profiler did not see the kernels inside the graph: profile the same step eagerly.
            eager = GraphRunner(model, kv, buffers, plan, use_graphs=False, stream=runner.stream)
            kernels = profile_steps(stepper(eager, step), sync, steps, cuda)
            source = "eager replays of the same step (graph kernels not visible to the profiler)"
        floors = step_floors(config, tokens, seqs, context, prefill, elem, bw, flops, weight_elem)
        if kernels:
            summary = summarize(kernels, config.num_layers, step_s, floors, num_steps=steps)
        else:
            summary = {"notes": ["the profiler recorded no kernels"]}
        kv_bytes = 0 if prefill else config.num_layers * seqs * context * 2 * config.kv_size * elem
        out[key] = {"tokens": tokens, "seqs": seqs, "context": context, "source": source, "graph": shape.graph,
                    "weights_kv_floor_s": (weight_bytes + kv_bytes) / bw, "kv_bytes": kv_bytes,
                    "step_from_idle_s": from_idle_s, **summary}
    del runner, kv, buffers, model
    if cuda:
        torch.cuda.empty_cache()
    return out


def render(breakdown: dict) -> list[str]:
    """Table lines: one column per step kind, ms per category and × its own floor."""
    keys = [k for k in breakdown if isinstance(breakdown[k], dict) and "categories" in breakdown[k]]
    if not keys:
        return []
    head = f"{'category (ms, x own floor)':28s}" + "".join(f" | {k:>19s}" for k in keys)
    lines = [head, "-" * len(head)]
    names = [n for n in CATEGORY_ORDER if any(n in breakdown[k]["categories"] for k in keys)]

    def cell(c: dict | None) -> str:
        if not c:
            return f"{'-':>19s}"
        x = f"{c['x_floor']:.2f}x" if c.get("x_floor") is not None else "-"
        return f"{c['time_s'] * 1e3:8.3f} {x:>10s}"

    for n in names:
        lines.append(f"{n:28s}" + "".join(f" | {cell(breakdown[k]['categories'].get(n))}" for k in keys))
    lines.append(f"{'step (GPU time) / floor sum':28s}" + "".join(
        f" | {breakdown[k]['step_s'] * 1e3:8.3f} {breakdown[k]['floor_s'] * 1e3:9.3f}f" for k in keys))
    if any("step_from_idle_s" in breakdown[k] for k in keys):
        lines.append(f"{'one step from an idle GPU':28s}" + "".join(
            f" | {breakdown[k]['step_from_idle_s'] * 1e3:8.3f} {'':10s}" if "step_from_idle_s" in breakdown[k]
            else f" | {'-':>19s}" for k in keys))
    lines.append(f"{'kernels per step':28s}" + "".join(f" | {breakdown[k]['kernels_per_step']:19.0f}" for k in keys))
    for k in keys:
        for note in breakdown[k].get("notes", []):
            lines.append(f"  {k}: {note}")
        unlisted = breakdown[k].get("unlisted_kernels") or []
        if unlisted:
            lines.append(f"  {k}: kernels no rule names (in other): " + "; ".join(
                f"{u['name'][:70]} {u['time_s'] * 1e3:.3f} ms" for u in unlisted[:5]))
    return lines


def summarize_trace(paths: list[Path], num_layers: int, steps: int) -> dict:
    """A profiler trace's kernels (every file's, on one clock), split into `steps` steps:
    each kernel's category and exclusive time, and the summary per category."""
    intervals = sorted(i for path in paths for i in kernel_intervals(path))
    if not intervals:
        raise SystemExit(f"no kernels in {', '.join(map(str, paths))}")
    kernels = exclusive_times(intervals)
    per = len(kernels) // steps
    split = [kernels[i * per:(i + 1) * per] for i in range(steps)] if len(kernels) % steps == 0 else [kernels]
    labels, _ = attribute([name for name, _ in split[0]], num_layers)
    step_s = (intervals[-1][1] - intervals[0][0]) / 1e6 / steps
    return {"kernels": [{"name": name, "category": classify(name), "label": label, "seconds": seconds}
                        for (name, seconds), label in zip(split[0], labels)],
            **summarize(split, num_layers, step_s, {}, num_steps=steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--trace", type=Path, nargs="+", help="summarize these profiler traces instead")
    parser.add_argument("--layers", type=int, help="with --trace: the model's decoder layers")
    parser.add_argument("--device", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=Path("breakdown.json"))
    parser.add_argument("--copy-bandwidth", type=float, help="bytes/s (default: measured here)")
    parser.add_argument("--matmul-flops", type=float, help="FLOP/s (default: measured here)")
    parser.add_argument("--steps", type=int, help="steps profiled per step kind (20), or in the --trace (1)")
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none",
                        help="fp8: the model's projections quantized to FP8 as it loads")
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else 1 if args.trace else 20
    if args.steps < 1:
        parser.error(f"--steps: at least 1 step, got {args.steps}")
    if args.trace:
        if args.layers is None:
            parser.error("--trace needs --layers (GEMMs are attributed to projections by position)")
        print(json.dumps(summarize_trace(args.trace, args.layers, args.steps), indent=2))
        return 0
    if args.model is None:
        parser.error("--model or --trace is required")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.copy_bandwidth and args.matmul_flops:
        ceilings = {"copy_bandwidth_Bps": args.copy_bandwidth, "matmul_flops": args.matmul_flops}
    else:
        ceilings = device_ceilings(args.device)
    if args.device == "cpu":
        environment.export_defaults({"TRITON_INTERPRET": "1"})
    result = run_breakdown(args.model, args.device, ceilings, steps=args.steps, quantization=args.quantization)
    args.out.write_text(json.dumps(result, indent=2))
    print("\n".join(render(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
