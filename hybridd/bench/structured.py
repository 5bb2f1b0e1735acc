"""The bench's structured-output part, at the client through the SDK.

`structured`: what a JSON schema costs a stream. The random checkpoint's word-level
tokenizer spells no JSON, so the part serves the same weights beside a byte-level BPE
tokenizer of the checkpoint's vocabulary size, trained here on local Python sources
(no download). Batch 1 and 32 concurrent streams (greedy, the same prompts), each
unconstrained and under a schema that keeps the output going (an array of at least 400
small objects); ITL p50 under the schema ÷ unconstrained. Schema compile time: fresh
schemas compiled in this process with the daemon's compiler and tokenizer (cold), and a
request's TTFT with a schema new to the daemon ÷ one it has cached. Targets (GPU):
ITL <= 1.10x at batch 1, <= 1.20x at 32 streams.
"""

from __future__ import annotations

import glob
import json
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from hybridd.bench.timing import at_most, concurrent_streams, itl_summary, random_prompt, ratio, ttft_summary

STREAMS = 32
PROMPT = 64


def schema(variant: int = 0) -> dict[str, Any]:
    """A schema whose documents run long (so that max_tokens ends the stream, not the
    document); `variant` makes a new one of the same cost."""
    row = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["lead", "chorus", "extra"]}, "sworn": {"type": "boolean"},
        f"tag{variant}": {"type": "number"}},
        "required": ["id", "name", "role", "sworn"], "additionalProperties": False}
    return {"type": "object", "properties": {"cast": {"type": "array", "items": row, "minItems": 400}},
            "required": ["cast"], "additionalProperties": False}


def structured_checkpoint(model: Path, out: Path) -> Path:
    """`model` itself, or where its tokenizer is the random checkpoint's word-level one, its
    weights and config in `out` beside a byte-level BPE tokenizer of its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    own = json.loads((model / "tokenizer.json").read_text()) if (model / "tokenizer.json").is_file() else {}
    if own.get("model", {}).get("type") not in (None, "WordLevel"):
        return model  # a real tokenizer spells JSON already
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            continue
        target = out / item.name
        if not target.exists():
            target.symlink_to(item.resolve())
    if (out / "tokenizer.json").exists():
        return out
    sources = sorted(glob.glob(str(Path(shutil.__file__).parent / "**" / "*.py"), recursive=True))[:3000]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = (Path(source).read_text(errors="ignore") for source in sources)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    return out


def compile_times(model: Path, schemas: int) -> dict[str, Any]:
    """Cold compile of `schemas` fresh schemas with the daemon's compiler and the model's tokenizer."""
    from hybridd.engine.grammar import GrammarCompiler
    from hybridd.model import load_tokenizer
    from hybridd.protocol.messages import StructuredOutput

    tokenizer = load_tokenizer(model)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id], timeout_s=600)
    prepare = time.perf_counter() - started
    times = []
    for variant in range(1, schemas + 1):
        started = time.perf_counter()
        compiler.compile(StructuredOutput(json=json.dumps(schema(1000 + variant))))
        times.append(time.perf_counter() - started)
    compiler.close()
    return {"tokenizer_entries": len(tokenizer), "prepare_tokenizer_s": prepare, "schemas": schemas,
            "compile_p50_s": statistics.median(times), "compile_max_s": max(times)}


def measure_structured(endpoint: str, model: Path, tokens: int, reps: int) -> dict[str, Any]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(21)
    constrained = {"json": json.dumps(schema())}
    out: dict[str, Any] = {"stream_tokens": tokens, "streams": STREAMS, "compile": compile_times(model, 5)}

    def run(prompts, structured):
        options = {"structured": structured} if structured is not None else {}
        return [gap for record in concurrent_streams(endpoint, prompts, tokens, **options) for gap in record.gaps]

    run([random_prompt(rng, PROMPT, vocab)], constrained)  # warm-ups: the schema compiled and cached
    run([random_prompt(rng, PROMPT, vocab)], None)
    single = [random_prompt(rng, PROMPT, vocab) for _ in range(reps)]
    many = [random_prompt(rng, PROMPT, vocab) for _ in range(STREAMS)]
    for name, prompts in (("batch_1", single), (f"streams_{STREAMS}", many)):
        gaps: dict[str, list[float]] = {"free": [], "schema": []}
        for structured in (None, constrained, None, constrained):  # interleaved, against drift
            key = "free" if structured is None else "schema"
            if name == "batch_1":
                for prompt in prompts:
                    gaps[key] += run([prompt], structured)
            else:
                gaps[key] += run(prompts, structured)
        free, constrained_itl = itl_summary(gaps["free"]), itl_summary(gaps["schema"])
        out[name] = {"itl_free": free, "itl_schema": constrained_itl,
                     "itl_p50_ratio": ratio(constrained_itl["p50_s"], free["p50_s"])}
    ttft_new, ttft_cached = [], []
    for variant in range(reps):
        fresh = {"json": json.dumps(schema(2000 + variant))}
        prompt = random_prompt(rng, PROMPT, vocab)
        ttft_new.append(concurrent_streams(endpoint, [prompt], 2, structured=fresh)[0].ttft)
        ttft_cached.append(concurrent_streams(endpoint, [prompt], 2, structured=fresh)[0].ttft)
    out["ttft_new_schema"], out["ttft_cached_schema"] = ttft_summary(ttft_new), ttft_summary(ttft_cached)
    out["targets_met"] = {"batch 1 itl <= 1.10x": at_most(out["batch_1"]["itl_p50_ratio"], 1.10),
                          f"{STREAMS} streams itl <= 1.20x": at_most(out[f"streams_{STREAMS}"]["itl_p50_ratio"], 1.20)}
    return out
