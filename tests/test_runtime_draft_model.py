"""The draft-model drafter through the two real worker processes, the draft model run
by the graph generator (its KV arena, its graphs: eager on the CPU), speculative_adaptive
false (every step speculates): greedy output, alone and batched, is the in-process
engine's without speculation, and a seeded sampled n > 1 request beside it gives the same
tokens again when sent alone twice (its draft tokens are kept by rejection sampling, so
not the tokens without speculation), on a tiny transformers-built target (GQA, tied
embeddings) with its tiny draft and on the embedded model with its shipped draft;
structured output (a JSON schema, a regex) is drafted for and gives the greedy output
without speculation, valid; status reports the draft model's KV arena and graphs, and
counts its verified drafts. A draft whose KV cache does not fit is refused at start,
naming it."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.generate import generate
from hybridd.model import load_model
from hybridd.model.tokenizer import load_tokenizer
from hybridd.protocol.messages import SamplingParams
from tests.engine_pair import EnginePair
from tests.host_load import on_this_host
from tests.speculation_helpers import (STRUCTURED_CASES, build_tiny_draft, repetitive_prompts,
                                        structured_through_daemon, structured_without_speculation,
                                        valid_structured_output)
from tests.test_start_refusals import refused_at_start
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.slow
DEVICE = os.environ.get("HYBRIDD_TEST_DEVICE", "cpu")
K = 4


def speculation(client) -> dict:
    return client.request({"type": "status"})["status"]["speculation"]


def draft_status(client, replays: int = 1, timeout: float = 30.0) -> dict:
    """The speculation status once the graph generator's counters (sent about once a
    second) show `replays` of the draft's decode graphs."""
    deadline = time.monotonic() + on_this_host(timeout)
    while True:
        status = speculation(client)
        buckets = status.get("draft_model", {}).get("buckets", [])
        if sum(b["replays"] for b in buckets if b["kind"] == "decode") >= replays or time.monotonic() > deadline:
            return status
        client.request({"type": "health"}, timeout=0.2)  # a round trip between looks


def outputs(client, requests: list[tuple[list[int], dict]]) -> list[list[list[int]]]:
    """Each request's choices' token ids, the requests sent together."""
    ids = [client.send({"type": "generate", "prompt_token_ids": p, "sampling": s, "stream": False})
           for p, s in requests]
    finals = [client.collect(rid)[0] for rid in ids]
    return [[c["token_ids"] for c in sorted(f["choices"], key=lambda c: c["index"])] for f in finals]


def without_speculation(model, requests: list[tuple[list[int], dict]]) -> list[list[list[int]]]:
    return [[list(seq.output_token_ids) for seq in generate(model, [p], SamplingParams(**s))[0]]
            for p, s in requests]


def check_seeded_sampling_repeats(client, prompt: list[int], sampled: dict, beside: list[list[int]]) -> None:
    """The seeded sampled request sent alone twice gives the same tokens each time (drafted
    the same: every step speculates), as many as asked, as it did beside others (`beside`)."""
    alone = [outputs(client, [(prompt, sampled)])[0] for _ in range(2)]
    assert alone[0] == alone[1]
    assert all(len(t) == sampled["max_tokens"] for t in alone[0] + beside)


# ---------------------------------------------------------- a tiny transformers target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama 3.2-shaped target and its one-layer draft, with the embedded model's
    tokenizer (the daemon reads one; the prompts are token ids)."""
    path = tmp_path_factory.mktemp("tiny-draft")
    target = build_tiny_model("llama3_2", path / "target", vocab_size=4096)
    build_tiny_draft(target, path / "draft", layers=1, noise=0.02)
    for directory in ("target", "draft"):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(EMBEDDED_MODEL / name, path / directory / name)
    (path / "run").mkdir()
    with EnginePair(path / "run", model=str(path / "target"), device=DEVICE, dtype="float32",
                    speculative_drafter="draft_model", speculative_draft_model=str(path / "draft"),
                    num_speculative_tokens=K, max_batch=8, decode_buckets=[1, 2, 4, 8],
                    speculative_adaptive=False) as engine:
        yield engine, load_model(path / "target", dtype=torch.float32)


def test_tiny_target_with_its_draft_greedy_equals_the_engine_and_seeded_sampling_repeats(tiny):
    engine, model = tiny
    prompts = repetitive_prompts((12, 20, 7), seed=3)
    greedy = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    sampled = {"max_tokens": 24, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 5, "n": 2,
               "repetition_penalty": 1.05, "ignore_eos": True}
    client = engine.client(version=4)
    try:
        alone = [(prompts[0], greedy)]
        assert outputs(client, alone) == without_speculation(model, alone)
        batched = [(prompts[1], greedy), (prompts[2], greedy), (prompts[0], sampled)]
        got = outputs(client, batched)
        assert got[:2] == without_speculation(model, batched[:2])
        check_seeded_sampling_repeats(client, prompts[0], sampled, got[2])
        status = draft_status(client)
    finally:
        client.close()
    assert status["drafter"] == "draft_model" and status["verify_steps"] > 0 and status["draft_tokens"] > 0, status
    draft = status["draft_model"]
    # Its own KV arena (a full batch of the longest sequences) and its own decode graphs, replayed.
    assert draft["kv_blocks"]["total"] > 0 and draft["kv_bytes"] > 0 and draft["drafts"] > 0, draft
    assert sum(b["replays"] for b in draft["buckets"] if b["kind"] == "decode") > 0, draft
    assert 0 < draft["memory_budget_bytes"] < 1024 << 20, draft  # its share of the graph memory budget


# ------------------------------------------------- the embedded model, its shipped draft


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("draft"), device=DEVICE, dtype="float32",
                    speculative_drafter="draft_model", num_speculative_tokens=K, max_batch=8,
                    speculative_adaptive=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def embedded():
    return load_model(EMBEDDED_MODEL, dtype=torch.float32), load_tokenizer(EMBEDDED_MODEL)


def test_draft_model_in_the_daemon_greedy_equals_the_engine_and_seeded_sampling_repeats(pair, embedded):
    model, tokenizer = embedded
    text = (EMBEDDED_MODEL / "validation.txt").read_text()
    prompts = [tokenizer.encode(text[a:a + 200]) for a in (0, 5000)]
    greedy = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    sampled = {"max_tokens": 24, "temperature": 0.8, "top_k": 40, "seed": 7, "n": 2, "ignore_eos": True}
    client = pair.client(version=4)
    try:
        got = outputs(client, [(prompts[0], greedy), (prompts[1], sampled)])
        assert got[0] == without_speculation(model, [(prompts[0], greedy)])[0]
        check_seeded_sampling_repeats(client, prompts[1], sampled, got[1])
        status = draft_status(client)
    finally:
        client.close()
    # Drafts were verified and kept (every step speculates; the shipped draft's acceptance is
    # measured in process, over the same drafting code: tests/test_speculative_draft_model.py).
    assert status["drafter"] == "draft_model" and status["verify_steps"] > 0 and status["accepted_tokens"] > 0, status
    assert status["draft_model"]["drafts"] > 0, status


@pytest.mark.parametrize("case", sorted(STRUCTURED_CASES))
def test_structured_output_is_drafted_for_and_equals_the_engine_without_speculation(pair, embedded, case):
    model, tokenizer = embedded
    client = pair.client(version=4)
    try:
        before = client.request({"type": "status"})["status"]["speculation"]
        got, text, finish_reason = structured_through_daemon(client, tokenizer, case)
        after = client.request({"type": "status"})["status"]["speculation"]
    finally:
        client.close()
    assert got == structured_without_speculation(model, tokenizer, case)
    assert finish_reason == "stop" and valid_structured_output(case, text)
    assert after["draft_tokens"] > before["draft_tokens"], (before, after)


def test_a_draft_whose_kv_cache_cannot_fit_is_refused_at_start(tmp_path):
    # The device's free memory as the graph generator reads it: less than the draft's KV cache.
    error = refused_at_start(tmp_path, "--speculative-drafter", "draft_model",
                             env={"HYBRIDD_TEST_FREE_MEMORY_BYTES": str(1 << 20)})
    assert "speculative_draft_model" in error and "its KV cache of" in error, error
