"""hybridd against its peers and the hardware floor, in one command, on the same weights.

The benchmark's entry point (`hybridd bench ...`, or `python -m hybridd.bench ...`): its
arguments, the parts it runs and their order, the time budget, and where it writes the
report (bench.json, the table: report.py). The parts' runners are parts.py, peers.py and
one module per part; the daemon under test and its client are server.py.

    hybridd bench --out $OUT/llama2-7b --budget-s 470                      # Llama-2-7B shape, bf16
    hybridd bench --out $OUT/llama3-8b --preset llama3-8b --budget-s 470   # Llama-3-8B shape
    hybridd bench --out $OUT --model /path/to/hf   # any local Hugging Face directory
    hybridd bench --out /tmp/b --device cpu --preset tiny --quick   # CI smoke, seconds
    hybridd bench --out $OUT/fp8 --parts ceilings,checkpoint,breakdown_fp8,fp8   # FP8 against bf16

Parts, in order: `ceilings` (copy bandwidth, matmul rate: the floors), `checkpoint`
(random weights of the preset's shape unless `--model`), `breakdown` (each step's
kernels by category: breakdown.py); then the real daemon (`hybridd start`), measured
at the client through the SDK: `hybridd_eager` (graphs off), `hybridd` (start phases on
empty compile caches, ITL during background capture, TTFT at 10-500 tokens, batch-1 ITL,
1-32 streams, graph memory, what the HTTP gateway adds: gateway.py), VARIANTS (one
setting changed), `capture_evict` (capture.py), `mixed_load` and `prefix_reuse`
(mixed.py), `structured` (structured.py), `speculation` and
`speculation_steps` (speculation.py), `speculation_client` (a daemon with prompt
lookup against one without, on the preset's weights made predictable, at set acceptance
lengths and 32 streams), `breakdown_fp8` and `fp8` (the model
quantized to FP8: its steps against the FP8 floor; a bf16 and an FP8 daemon on the same
weights, and FP8 weights with an FP8 KV cache), and the peers on the same weights: `hf_eager`, `hf_static` (transformers
`generate()`, static cache and torch.compile). A part is skipped, the reason recorded,
where `--budget-s` would be exceeded; a failure is recorded and the run goes on;
bench.json is rewritten after every part. docs/lab/benchmarks.md reads the figures;
plot with `python docs/lab/benchmarks_plot.py OUT/*/bench.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hybridd import environment
from hybridd.bench.parts import (count_params, floors, make_model, run_breakdown_subprocess, run_capture_evict,
                                 run_fp8, run_hybridd, run_speculation_client, run_variant)
from hybridd.bench.peers import free_hf, run_hf
from hybridd.bench.plan import VARIANTS
from hybridd.bench.provenance import git_rev, model_shape_name, source_digest
from hybridd.bench.report import build_report, dig, render_table
from hybridd.bench.server import on_empty_compile_caches, start_server
from hybridd.bench.timing import device_ceilings

ITL_TOKENS = 256

# Run after the peers: they fit only where the budget leaves time.
LATE_VARIANTS = ("hybridd_poll", "hybridd_no_wake")

# Estimated seconds per part on an H200 with the Llama-2-7B / Llama-3-8B shape (the budget check uses them).
ESTIMATE_S_7B = {"ceilings": 8, "checkpoint": 60, "breakdown": 45, "hybridd_eager": 50, "hybridd": 110,
                 "capture_evict": 60, "hf_eager": 45, "hf_static": 60, "mixed_load": 60,
                 "prefix_reuse": 45, "structured": 150, "speculation": 90,
                 "speculation_steps": 110, "speculation_client": 200, "breakdown_fp8": 45,
                 "fp8": 170} | dict.fromkeys(VARIANTS, 60)
ESTIMATE_S_SMALL = {"ceilings": 3, "checkpoint": 5, "breakdown": 10, "hybridd_eager": 12, "hybridd": 20,
                    "capture_evict": 20, "hf_eager": 8, "hf_static": 60, "mixed_load": 30,
                    "prefix_reuse": 30, "structured": 60, "speculation": 60,
                    "speculation_steps": 60, "speculation_client": 60, "breakdown_fp8": 10,
                    "fp8": 45} | dict.fromkeys(VARIANTS, 20)
# What --skip may name: the parts, and the HTTP gateway's figures inside the hybridd part.
SKIPPABLE = frozenset(ESTIMATE_S_7B) | {"gateway"}
LARGE_PRESETS = ("llama2-7b", "llama3-8b")
# What a preset measures unless --skip says otherwise: the second shape runs the parts that
# show its kernels and latency (breakdown, TTFT, ITL, streams, forced capture, peers), so that
# it fits 10 minutes.
PRESET_SKIP = {"llama3-8b": ("hybridd_eager", *VARIANTS, "gateway")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybridd bench", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, help="local HF directory (default: random weights of --preset)")
    p.add_argument("--preset", default=None, choices=("llama2-7b", "llama3-8b", "llama-1b", "small", "tiny"),
                   help="random weights of this shape: llama2-7b (default on CUDA), llama3-8b, llama-1b, small, "
                        "tiny (default on CPU); llama3-8b skips by default " + ", ".join(PRESET_SKIP["llama3-8b"]))
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--quick", action="store_true", help="fewer repetitions and tokens")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip parts that would end later than this")
    p.add_argument("--checkpoint-dir", type=Path, help="where random checkpoints are written (default: tmp)")
    p.add_argument("--parts", default=None, help="comma-separated parts to run, the others skipped (instead of "
                   "--skip; the parts run in the order of the list above)")
    p.add_argument("--skip", default=None, help="comma-separated parts to skip (and `gateway`: the gateway "
                   "figures of the hybridd part); default: none, or the preset's list")
    p.add_argument("--long-prompt", type=int, default=2000, help="tokens of mixed_load's and prefix_reuse's "
                   "long prompts")
    p.add_argument("--turn-tokens", type=int, default=200, help="tokens prefix_reuse's chat adds a turn")
    p.add_argument("--verbose", action="store_true", help="the workers' info logs")
    p.add_argument("--first-start", action=argparse.BooleanOptionalAction, default=True,
                   help="start the `hybridd` part on compile caches of its own, empty (a first start on the host: "
                        "it compiles every kernel); --no-first-start: on those the parts before it filled")
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.preset is None:
        args.preset = "llama2-7b" if args.device == "cuda" else "tiny"
    args.ttft_reps = 3 if args.quick else 7
    args.itl_tokens = 32 if args.quick else ITL_TOKENS
    args.itl_runs = 1 if args.quick else 2
    args.concurrency_tokens = 16 if args.quick else 128

    def parts(flag: str, text: str, empty_ok: bool) -> set[str]:
        named = {s.strip() for s in text.split(",") if s.strip()}
        unknown = sorted(named - SKIPPABLE)
        if unknown or not (named or empty_ok):
            p.error(f"{flag}: unknown part(s) {', '.join(unknown) or '(none named)'}; the parts are "
                    f"{', '.join(sorted(SKIPPABLE))}")
        return named

    if args.skip is None:
        args.skip = ",".join(PRESET_SKIP.get(args.preset, ()))
    args.skip_set = parts("--skip", args.skip, True)
    if args.parts is not None:
        args.skip_set = set(SKIPPABLE) - parts("--parts", args.parts, False)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        environment.export_defaults({"TRITON_INTERPRET": "1"})  # as tests/conftest.py: no kernel compiles on the CPU
    if not args.verbose:
        environment.export_defaults({"HYBRIDD_LOG_LEVEL": "warning"})  # inherited by the spawned workers
    args.out.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    deadline = t_begin + args.budget_s
    import torch

    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([sys.executable, *sys.argv]),
        "python": platform.python_version(), "torch": torch.__version__, "preset": args.preset,
        "device": args.device, "quick": args.quick, "budget_s": args.budget_s, "skipped": {}, "errors": {},
        "notes": [], "part_s": {}, "git": git_rev(), "source_sha256": source_digest(),
    }
    with contextlib.suppress(ImportError):
        import transformers

        meta["transformers"] = transformers.__version__
    results: dict[str, Any] = {"meta": meta}
    estimates = ESTIMATE_S_7B if args.preset in LARGE_PRESETS and args.device == "cuda" else ESTIMATE_S_SMALL
    skip = args.skip_set
    meta["shape"] = model_shape_name(args)
    cuda_only = {"hf_static": "CUDA only (reduce-overhead compiles to CUDA graphs)",
                 **{name: f"CUDA only ({why})" for name, (_, _, why) in VARIANTS.items()}}
    shared: dict[str, Any] = {}
    state: dict[str, Any] = {"model": args.model}

    def write() -> None:
        meta["total_s"] = time.perf_counter() - t_begin
        results["table"], results["targets"] = build_report(results)
        (args.out / "bench.json").write_text(json.dumps(results, indent=2, default=str))

    def part(name: str, fn, needs: tuple[str, ...] = (), key: str | None = None) -> None:
        key = key or name
        elapsed = time.perf_counter() - t_begin
        reason = None
        if name in skip:
            reason = "--skip"
        elif args.device != "cuda" and name in cuda_only:
            reason = cuda_only[name]
        elif any(state.get(n) is None for n in needs):
            reason = f"needs {', '.join(needs)}"
        elif name != "checkpoint" and elapsed + estimates.get(name, 0) > args.budget_s:
            reason = f"time budget: {elapsed:.0f} s spent + ~{estimates.get(name, 0)} s > {args.budget_s:.0f} s"
        if reason:
            meta["skipped"][name] = reason
            print(f"[bench] skip {name}: {reason}", flush=True)
            return
        print(f"[bench] {name} ... (t={elapsed:.0f} s)", flush=True)
        t0 = time.perf_counter()
        state["running"] = name
        try:
            out = results.setdefault(key, {})
            value = fn(out)
            if value is not None:
                results[key] = value
            elif not out:
                results.pop(key)
        except Exception as exc:
            meta["errors"][name] = "".join(traceback.format_exception_only(type(exc), exc)).strip() + "\n" + \
                traceback.format_exc(limit=-3)
            print(f"[bench] {name} FAILED: {exc}", flush=True)
            traceback.print_exc()
            if not results.get(key):
                results.pop(key, None)
        state["running"] = None
        meta["part_s"][name] = time.perf_counter() - t0
        print(f"[bench] {name} done in {meta['part_s'][name]:.1f} s", flush=True)
        write()

    def do_ceilings(_):
        state["ceilings"] = device_ceilings(args.device)
        return state["ceilings"]

    def do_checkpoint(_):
        if args.model is None:
            state["model"] = make_model(args)
        meta["model"] = str(state["model"])
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(state["model"]))
        state["vocab"] = config.vocab_size
        elem = 2 if args.device == "cuda" else 4  # hybridd's dtype: bf16 on CUDA, float32 on the CPU
        params = count_params(state["model"])
        if state.get("ceilings"):
            results["floors"] = floors(params, elem, state["ceilings"])
        return None

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        part("ceilings", do_ceilings, key="device")
        part("checkpoint", do_checkpoint)
        if args.model is not None and "model" not in meta:
            meta["model"] = str(args.model)
        vocab = lambda: state["vocab"]  # noqa: E731
        part("breakdown", lambda out: run_breakdown_subprocess(args, state["model"], state["ceilings"], deadline),
             needs=("model", "ceilings"))
        part("hybridd_eager", lambda out: run_hybridd(args, state["model"], vocab(), False, deadline, out),
             needs=("model", "vocab"))
        def do_hybridd(out):
            run = lambda: run_hybridd(args, state["model"], vocab(), True, deadline, out)  # noqa: E731
            return on_empty_compile_caches(run) if args.first_start else run()

        part("hybridd", do_hybridd, needs=("model", "vocab"))
        meta["client"] = dig(results, "hybridd", "client") or dig(results, "hybridd_eager", "client")

        def variant(name: str) -> None:
            part(name, lambda out: run_variant(args, state["model"], vocab(), deadline, out, results.get("hybridd", {}),
                                               VARIANTS[name][0]), needs=("model", "vocab"))

        for name in VARIANTS:
            if name not in LATE_VARIANTS:
                variant(name)
        part("capture_evict", lambda out: run_capture_evict(args, state["model"], vocab(), meta["notes"]),
             needs=("model", "vocab"))

        def on_daemon(name: str, measure, **overrides) -> None:
            def run(_):
                with start_server(args, state["model"], **overrides) as server:
                    return measure(server.endpoint)

            part(name, run, needs=("model", "vocab"))

        from hybridd.bench.mixed import measure_mixed_load, measure_prefix_reuse

        on_daemon("mixed_load", lambda endpoint: measure_mixed_load(
            endpoint, vocab(), args.long_prompt, args.itl_tokens, args.ttft_reps))
        on_daemon("prefix_reuse", lambda endpoint: measure_prefix_reuse(
            endpoint, vocab(), args.long_prompt, args.turn_tokens, 8, args.ttft_reps))

        def structured(_):
            from hybridd.bench.structured import measure_structured, structured_checkpoint

            model = structured_checkpoint(state["model"], Path(str(state["model"]) + "-bpe"))
            with start_server(args, model) as server:
                return measure_structured(server.endpoint, model, args.itl_tokens, args.ttft_reps)

        part("structured", structured, needs=("model", "vocab"))

        from hybridd.bench.speculation import measure_speculation, measure_speculation_steps

        on_daemon("speculation", lambda endpoint: measure_speculation(
            endpoint, state["model"], vocab(), 16 if args.quick else 64, 1 if args.quick else 3),
            speculative_drafter="ngram")
        part("speculation_steps", lambda out: measure_speculation_steps(
            state["model"], args.device, 16 if args.quick else 64, reps=3 if args.quick else 20,
            quick=args.quick or args.device != "cuda"),
            needs=("model", "vocab"))
        part("speculation_client", lambda out: run_speculation_client(args, out))
        part("hf_eager", lambda out: run_hf(args, state["model"], vocab(), "eager", deadline, shared, out),
             needs=("model", "vocab"))
        part("hf_static", lambda out: run_hf(args, state["model"], vocab(), "static", deadline, shared, out),
             needs=("model", "vocab"))
        part("breakdown_fp8", lambda out: run_breakdown_subprocess(args, state["model"], state["ceilings"], deadline,
                                                                    "fp8"), needs=("model", "ceilings"))
        part("fp8", lambda out: run_fp8(args, state["model"], vocab(), deadline, out), needs=("model", "vocab"))
        for name in LATE_VARIANTS:
            variant(name)
    finally:  # also on SIGTERM (a run past the device's limit): keep what was measured
        if state.get("running"):
            meta["errors"][state["running"]] = "interrupted (SIGTERM or KeyboardInterrupt); partial results kept"
        free_hf(shared)
        write()
        table = render_table(results)
        (args.out / "bench_table.txt").write_text(table + "\n")
        print("\n" + table, flush=True)
    return 0
