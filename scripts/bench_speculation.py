"""Speculative decoding on the CPU, in process: tokens/s and mean acceptance length of
each drafter against no speculation, in the same run, on the same prompts.

The engine core (scheduler, block manager, sampler, verify steps) drives the model in
this process (`InProcessRunner`), one step deep, as the tests' reference does; each
configuration decodes the same prompts (passages of the embedded model's validation
text) after one warm-up run. The output of every configuration is checked equal to the
one without speculation (greedy), so a figure never comes from a wrong output.

    python -m scripts.bench_speculation                      # embedded model, its shipped draft
    python -m scripts.bench_speculation --drafters none draft_model --batch 1 4 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hybridd.config import EMBEDDED_DRAFT_MODEL, EMBEDDED_MODEL
from hybridd.engine.block_manager import BlockManager
from hybridd.engine.core import EngineCore
from hybridd.engine.in_process_runner import InProcessRunner
from hybridd.engine.scheduler import Scheduler
from hybridd.engine.speculation.policy import SpeculationPolicy
from hybridd.engine.speculation.registry import make_drafter
from hybridd.engine.speculation.speculator import Speculator
from hybridd.model import load_model
from hybridd.model.kv_cache import KVCache
from hybridd.model.tokenizer import load_tokenizer
from hybridd.protocol.messages import SamplingParams


def run(model, prompts, params, speculator, block_size: int = 16):
    num_blocks = sum(-(-(len(p) + params.max_tokens + 16) // block_size) for p in prompts) + 8
    kv = KVCache.allocate(model.config, num_blocks + 1, block_size, model.dtype, model.device)
    k = speculator.max_tokens if speculator is not None else 0
    scheduler = Scheduler(BlockManager(num_blocks, block_size, watermark=0.0), max_batch=len(prompts),
                          max_prefill_tokens=4096, max_model_len=model.max_positions,
                          eos_token_ids=model.config.eos_token_ids, speculator=speculator,
                          max_verify_rows=len(prompts) * (k + 1))
    core = EngineCore(scheduler, InProcessRunner(model, kv), pipeline_depth=1)
    requests = [core.add(str(i), p, params) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    while core.has_work:
        core.step()
    seconds = time.perf_counter() - started
    return [list(r.seqs[0].output_token_ids) for r in requests], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(EMBEDDED_MODEL))
    parser.add_argument("--draft-model", default=str(EMBEDDED_DRAFT_MODEL))
    parser.add_argument("--drafters", nargs="+", default=["none", "ngram", "draft_model"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32)
    tokenizer = load_tokenizer(args.model)
    text = (EMBEDDED_MODEL / "validation.txt").read_text()
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    results = []
    for batch in args.batch:
        prompts = [tokenizer.encode(text[a:a + 300]) for a in range(0, 7919 * batch, 7919)]
        plain = None
        for name in args.drafters:
            def speculator():
                drafter = make_drafter(name, 1, 4, args.draft_model, model.max_positions, 8192)
                if drafter is None:
                    return None
                # Always speculating (the policy's per-batch-size choice would turn a loss off).
                return Speculator(drafter, args.k, SpeculationPolicy(args.k, adaptive=False))
            run(model, prompts, params, speculator())  # warm-up
            spec = speculator()
            outputs, seconds = run(model, prompts, params, spec)
            if plain is None:
                plain = outputs
            assert outputs == plain, f"{name}: output differs from the first drafter's"
            row = {"drafter": name, "batch": batch, "k": args.k, "tokens": sum(map(len, outputs)),
                   "tokens_per_s": round(sum(map(len, outputs)) / seconds, 1)}
            if spec is not None:
                row |= {"mean_acceptance_length": spec.stats.mean_acceptance_length,
                        "acceptance_rate": spec.stats.acceptance_rate}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
