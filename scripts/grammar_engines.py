"""Lab: llguidance against xgrammar on what structured output costs hybridd's serving loop.

For each engine and tokenizer: the time to prepare the tokenizer once, to compile a
JSON schema (cold, each schema new to the engine), and the time to compute one token's
allowed-token bitmask (then advance by the token) along a valid answer, per token.
Usage (xgrammar is not a dependency: install both engines apart, e.g. with
`pip install --target DIR llguidance xgrammar apache-tvm-ffi` and PYTHONPATH=DIR):

    python -m scripts.grammar_engines --tokenizer hybridd/assets/tiny-shakespeare [--tokenizer DIR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Juliet Capulet", "age": 13}),
    "tool_args": ({"type": "object", "properties": {
        "location": {"type": "string", "description": "city and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"}},
        "required": ["location", "unit", "days"], "additionalProperties": False},
        {"location": "Verona, Italy", "unit": "celsius", "days": 7, "hourly": False}),
    "nested": ({"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "actor": {"type": "string"}, "role": {"type": "string"}, "lines": {"type": "integer"}},
            "required": ["actor", "role"], "additionalProperties": False}, "minItems": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "number"}},
        "required": ["title", "year", "cast"], "additionalProperties": False},
        {"title": "Romeo and Juliet", "year": 1597, "cast": [
            {"actor": "Richard Burbage", "role": "Romeo", "lines": 612},
            {"actor": "Robert Goffe", "role": "Juliet", "lines": 541}], "tags": ["tragedy", "love"], "rating": 4.5}),
}


def load(path: str):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception:  # a bare tokenizer.json
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json")
    if tokenizer.eos_token_id is None:
        tokenizer.eos_token = "</s>"
    return tokenizer


def answer_ids(tokenizer, instance) -> list[int]:
    return tokenizer.encode(json.dumps(instance), add_special_tokens=False) + [tokenizer.eos_token_id]


def bench_llguidance(tokenizer, vocab: int, schemas) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    prepare = time.perf_counter() - started
    out = {"prepare_tokenizer_s": prepare}
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    for name, (schema, instance) in schemas.items():
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - started
        assert not matcher.is_error(), matcher.get_error()
        times = []
        for token in answer_ids(tokenizer, instance):
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - started)
            assert matcher.consume_token(token), (name, token, matcher.get_error())
        out[name] = {"compile_s": compile_s, "mask_us_mean": 1e6 * statistics.fmean(times),
                     "mask_us_p50": 1e6 * statistics.median(times), "mask_us_max": 1e6 * max(times),
                     "tokens": len(times)}
    return out


def bench_xgrammar(tokenizer, vocab: int, schemas) -> dict:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    prepare = time.perf_counter() - started
    out = {"prepare_tokenizer_s": prepare}
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    for name, (schema, instance) in schemas.items():
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=True)
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - started
        times = []
        for token in answer_ids(tokenizer, instance):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - started)
            assert matcher.accept_token(token), (name, token)
        out[name] = {"compile_s": compile_s, "mask_us_mean": 1e6 * statistics.fmean(times),
                     "mask_us_p50": 1e6 * statistics.median(times), "mask_us_max": 1e6 * max(times),
                     "tokens": len(times)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", action="append", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for path in args.tokenizer:
        tokenizer = load(path)
        vocab = len(tokenizer)
        for engine, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            results[f"{engine} @ {path} ({vocab} tokens)"] = bench(tokenizer, vocab, SCHEMAS)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
