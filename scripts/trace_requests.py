"""Where a request's time to first token goes: trace whole requests (prefill and
decode steps) through both workers, kernels and host-side CUDA calls, and print each
request's client-side timeline.

    python scripts/trace_requests.py --out $OUT            # random Llama-2-7B shape, CUDA

Starts the two workers (graphs on), sends `--requests` sequential requests of
`--prompt-len` tokens and `--max-tokens` tokens after a warm-up, and records the
workers' profiler traces (`trace-context-*.json`, `trace-graph-*.json`, see
hybridd/runtime/step_trace.py) over those requests, plus `timeline.json`: per
request, the client's send time and the arrival of each chunk (perf_counter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--prompt-len", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--warmup-requests", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    steps_per_request = 1 + args.max_tokens  # a prefill, then decode steps (one past the last token at most)
    os.environ["HYBRIDD_TRACE_DIR"] = str(args.out)
    os.environ["HYBRIDD_TRACE_CPU"] = "1"
    os.environ["HYBRIDD_TRACE_WARMUP"] = str(args.warmup_requests * steps_per_request + 1)
    os.environ["HYBRIDD_TRACE_STEPS"] = str(args.requests * steps_per_request)
    if args.model is None:
        from make_random_checkpoint import make_checkpoint

        args.model = make_checkpoint(Path(f"/tmp/hybridd-{args.preset}-normal-random"), args.preset)
    from tests.engine_pair import EnginePair

    pair = EnginePair(Path(tempfile.mkdtemp(prefix="hbt-")), model=str(args.model), device=args.device,
                      compile_sampler=args.device == "cuda", **({"kv_cache_memory_fraction": 0.3} if args.device == "cuda" else {}))
    timeline, client = [], None
    try:
        pair.wait_ready(timeout=600)
        client = pair.client()
        time.sleep(3)  # background prefill capture
        for i in range(args.warmup_requests + args.requests + 2):
            sent = time.perf_counter()
            client.send({"type": "generate", "prompt_token_ids": [5 + (7 * i + j) % 1000 for j in range(args.prompt_len)],
                         "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0}, "stream": True})
            chunks = []
            while True:
                message = client.recv(60)
                if message is None:
                    raise TimeoutError("no reply")
                chunks.append(time.perf_counter())
                if message.get("type") != "chunk":
                    break
            timeline.append({"request": i, "sent": sent, "chunks_ms": [(t - sent) * 1e3 for t in chunks]})
            print(f"request {i}: chunks at " + ", ".join(f"{(t - sent) * 1e3:.2f}" for t in chunks) + " ms", flush=True)
        time.sleep(1)
    finally:
        if client is not None:
            client.close()
        pair.close()
    (args.out / "timeline.json").write_text(json.dumps(timeline, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
