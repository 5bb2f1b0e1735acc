"""The Hugging Face peers on the same weights: transformers `generate()` eager
(DynamicCache, `hf_eager`) and with a static cache and torch.compile (`hf_static`), each
token timestamped on the host as it exists for the caller.
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path

from hybridd.bench.measurements import measure_batch1
from hybridd.bench.plan import ITL_PROMPT, TTFT_LENGTHS
from hybridd.bench.timing import StreamRecord, random_prompt


def hf_load(model: Path, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, device_map=device)
    except (ImportError, ValueError):  # device_map needs accelerate; load on the host, then move
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(device)
    hf.eval()
    return hf, time.perf_counter() - t0


def hf_generation_config(hf, max_new_tokens: int):
    import copy

    config = copy.deepcopy(hf.generation_config)
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(config, name):
            setattr(config, name, None)
    # Like ignore_eos: always max_new_tokens tokens. generate() fills unset fields from the
    # model's own generation config, so EOS is removed there too.
    hf.generation_config.eos_token_id = None
    for name, value in {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "max_new_tokens": max_new_tokens,
                        "min_new_tokens": None}.items():
        setattr(config, name, value)
    return config


def hf_timed_generate(hf, ids: list[int], max_new_tokens: int, config) -> StreamRecord:
    """Generate with a streamer that timestamps each new token on the host. On CUDA,
    generate() copies each step's token to the host before handing it to the streamer,
    so a timestamp is the moment that token exists for the caller."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        prompt_seen = False

        def put(self, value):
            now = time.perf_counter()
            if self.prompt_seen:  # generate() first puts the prompt
                record.times.append(now)
                record.tokens += 1
            self.prompt_seen = True

        def end(self):
            pass

    device = hf.device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    mask = torch.ones_like(input_ids)
    config.max_new_tokens = max_new_tokens
    if getattr(config, "bench_force_min_new_tokens", False):
        config.min_new_tokens = max_new_tokens
    if device.type == "cuda":
        torch.cuda.synchronize()
    record = StreamRecord(time.perf_counter())
    hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, streamer=Stamps())
    return record


def hf_stream_fns(hf, config):
    def ttft(ids, max_tokens):
        return hf_timed_generate(hf, ids, max_tokens, config).ttft

    def gaps(ids, max_tokens):
        record = hf_timed_generate(hf, ids, max_tokens, config)
        if record.tokens != max_tokens and not getattr(config, "bench_force_min_new_tokens", False):
            # EOS still stopped it (a transformers version that restores EOS): force the length.
            config.bench_force_min_new_tokens = True
            record = hf_timed_generate(hf, ids, max_tokens, config)
        if record.tokens != max_tokens:
            raise RuntimeError(f"HF generated {record.tokens} tokens, expected {max_tokens}")
        return record.gaps

    return ttft, gaps


def run_hf(args, model: Path, vocab: int, variant: str, deadline: float, shared: dict, result: dict) -> None:
    """variant: "eager" (DynamicCache) or "static" (StaticCache + torch.compile); fills `result`."""
    hf = shared.get("hf")
    result["transformers"] = __import__("transformers").__version__
    if hf is None:
        hf, result["load_s"] = hf_load(model, args.device)
        shared["hf"] = hf
    config = hf_generation_config(hf, 1)
    rng = random.Random(3)
    if variant == "static":
        config.cache_implementation = "static"
        if hasattr(config, "max_cache_len"):  # one cache size for every call (the first, longest): no recompile
            config.max_cache_len = max(TTFT_LENGTHS) + args.itl_tokens
        from transformers import CompileConfig

        config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        result["compile"] = ('generate()\'s own compile of the decode step, '
                             'CompileConfig(fullgraph=True, mode="reduce-overhead")')
        # Warm-up: the longest call first (it sizes the static cache), then the measured shapes.
        t0 = time.perf_counter()
        hf_timed_generate(hf, random_prompt(rng, max(TTFT_LENGTHS), vocab), args.itl_tokens, config)
        for _ in range(2):
            hf_timed_generate(hf, random_prompt(rng, ITL_PROMPT, vocab), args.itl_tokens, config)
        result["warmup_s"] = time.perf_counter() - t0
    measure_batch1(hf_stream_fns(hf, config), TTFT_LENGTHS, args, vocab, rng, deadline, result)


def free_hf(shared: dict) -> None:
    import torch

    shared.pop("hf", None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        torch._dynamo.reset()
    except Exception:
        pass
