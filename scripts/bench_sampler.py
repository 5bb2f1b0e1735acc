"""The sampler side by side on one GPU: its fused Triton kernels against the same
functions compiled by torch.compile (how hybridd sampled before) and run eagerly.

For each vocabulary, batch size and path it reports the GPU time of one call (the
calls queued behind a GPU sleep, so that host launches do not pace them) and the host
time of one call (launches only, the GPU far behind), and the time each takes to
compile from cold caches.

    python scripts/bench_sampler.py --out bench_sampler.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SAMPLERS = ("fused", "torch_compile", "eager")
PATHS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.8, seed=1),
    "top_k_top_p": dict(temperature=0.8, top_k=40, top_p=0.9, seed=1),
    "penalised_random": dict(temperature=0.8, seed=1, presence_penalty=0.5, repetition_penalty=1.1),
}


def sizes(text: str) -> list[int]:
    """A comma-separated list of positive integers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    parser.add_argument("--vocab", type=sizes, default="32000,128256", help="vocabulary sizes, comma-separated")
    parser.add_argument("--batch", type=sizes, default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=16, help="calls per measurement round")
    parser.add_argument("--samplers", default="fused,torch_compile,eager",
                        help="which samplers to time, comma-separated (fused is always compiled and timed)")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    unknown = set(args.samplers.split(",")) - set(SAMPLERS)
    if unknown:
        parser.error(f"unknown samplers {sorted(unknown)}; known: {', '.join(SAMPLERS)}")
    return args


def main() -> None:
    args = parse_args()
    # Cold caches: each sampler's compile time is from nothing, as on a fresh machine.
    scratch = tempfile.mkdtemp(prefix="bench-sampler-")
    os.environ["TRITON_CACHE_DIR"] = f"{scratch}/triton"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{scratch}/inductor"
    import torch

    from hybridd.engine import sampler as S
    from hybridd.protocol.messages import SamplingParams

    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler.py times GPU kernels and needs a CUDA device")
    torch.zeros(1, device="cuda")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": args.calls,
                    "rows": []}
    for vocab in args.vocab:
        samplers = {}
        t0 = time.perf_counter()
        fused = S.Sampler(compile=True)
        assert fused.warm_up(vocab, "cuda") == {}
        torch.cuda.synchronize()
        result.setdefault("compile_s", {})[f"fused/{vocab}"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(result["compile_s"]), flush=True)
        samplers["fused"] = fused
        wanted = set(args.samplers.split(","))
        if "eager" in wanted:
            samplers["eager"] = S.Sampler(compile=False)
        if "torch_compile" in wanted:
            t0 = time.perf_counter()
            samplers["torch_compile"] = TorchCompiled(S, vocab)
            result["compile_s"][f"torch_compile/{vocab}"] = round(time.perf_counter() - t0, 2)
            print(json.dumps(result["compile_s"]), flush=True)
        for name, kwargs in PATHS.items():
            for batch in args.batch:
                params = [SamplingParams(**kwargs)] * batch
                history = [[1, 2, 3]] * batch
                tensors = S.SamplingTensors.build(params, [1] * batch, [5] * batch, vocab, "cuda", history, history)
                logits = torch.randn(batch, vocab, device="cuda")
                row = {"vocab": vocab, "path": name, "batch": batch}
                for label, sampler in samplers.items():
                    for logprobs in (False, True):
                        call = (lambda s=sampler: s.sample(logits, tensors, with_logprobs=True)) if logprobs \
                            else (lambda s=sampler: s(logits, tensors))
                        gpu_us, host_us = time_call(torch, call, args.calls)
                        key = label + ("+logprobs" if logprobs else "")
                        row[key] = {"gpu_us": round(gpu_us, 1), "host_us": round(host_us, 1)}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["compile_s"]))


class TorchCompiled:
    """The eager functions under torch.compile(dynamic=True), every path compiled up front."""

    def __init__(self, S, vocab: int) -> None:
        import torch

        kwargs = dict(dynamic=True, fullgraph=True)
        self.S = S
        self.greedy = torch.compile(S._sample_greedy, **kwargs)
        self.random = torch.compile(S._sample_random, **kwargs)
        self.sorted = torch.compile(S._sample_sorted, **kwargs)
        self.processed = torch.compile(S._processed, **kwargs)
        from hybridd.protocol.messages import SamplingParams

        for kwargs in PATHS.values():
            for rows in (1, 3):
                params = [SamplingParams(**kwargs)] * rows
                history = [[1]] * rows
                t = S.SamplingTensors.build(params, [0] * rows, [0] * rows, vocab, "cuda", history, history)
                logits = torch.randn(rows, vocab, device="cuda")
                self.sample(logits, t, with_logprobs=True)

    def __call__(self, logits, t):
        penalties = self.S._penalty_tensors(t)
        if t.all_greedy:
            return self.greedy(logits, *penalties)
        fn = self.sorted if t.do_sort else self.random
        return fn(logits, t.inverse_temperature, t.top_k, t.top_p, *penalties, t.seeds, t.positions)

    def sample(self, logits, t, with_logprobs: bool = False):
        tokens = self(logits, t)
        return tokens, self.logprobs(logits, t, tokens) if with_logprobs else None

    def logprobs(self, logits, t, tokens):
        processed = self.processed(logits, t.inverse_temperature, t.top_k, t.top_p, *self.S._penalty_tensors(t),
                                   t.do_sort)
        return self.S._logprobs(processed, tokens)


def time_call(torch, call, calls: int, rounds: int = 3) -> tuple[float, float]:
    """(GPU µs, host µs) per call, medians over `rounds`. The calls queue behind a GPU
    sleep: the events then time the GPU alone, and the host's loop its launches alone.
    `calls` stays small enough that the launch queue never fills (a full queue would
    make the host wait for the sleep)."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu, host = [], []
    for _ in range(rounds):
        torch.cuda._sleep(300_000_000)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / calls * 1000)
    return sorted(gpu)[rounds // 2], sorted(host)[rounds // 2]


if __name__ == "__main__":
    main()
