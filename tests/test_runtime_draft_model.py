"""The draft-model drafter through the two real worker processes: the daemon with
speculative_drafter draft_model (the embedded model's shipped draft, in the context
generator) and speculative_adaptive false (every step speculates) gives the in-process
engine's greedy output without speculation, with a seeded sampled request beside it; a
seeded n > 1 request sent again alone gives the same tokens again; structured output
(a JSON schema, a regex) is drafted for and gives the greedy output without speculation,
valid; its status counts the draft model's verified drafts."""

from __future__ import annotations

import os

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.generate import generate
from hybridd.model import load_model
from hybridd.model.tokenizer import load_tokenizer
from hybridd.protocol.messages import SamplingParams
from tests.engine_pair import EnginePair
from tests.speculation_helpers import (STRUCTURED_CASES, structured_through_daemon, structured_without_speculation,
                                        valid_structured_output)

pytestmark = pytest.mark.slow
DEVICE = os.environ.get("HYBRIDD_TEST_DEVICE", "cpu")
K = 4


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
        ids = [client.send({"type": "generate", "prompt_token_ids": prompts[0], "sampling": greedy, "stream": False}),
               client.send({"type": "generate", "prompt_token_ids": prompts[1], "sampling": sampled,
                            "stream": False})]
        finals = [client.collect(rid)[0] for rid in ids]
        # The seeded request alone, twice: drafted the same each time, the same tokens.
        alone = [client.generate(prompt_token_ids=prompts[1], sampling=sampled, stream=False)[0] for _ in range(2)]
        status = client.request({"type": "status"})["status"]["speculation"]
    finally:
        client.close()
    (plain_greedy,) = generate(model, [prompts[0]], SamplingParams(**greedy))
    assert finals[0]["choices"][0]["token_ids"] == list(plain_greedy[0].output_token_ids)

    def tokens(final: dict) -> list[list[int]]:
        return [c["token_ids"] for c in sorted(final["choices"], key=lambda c: c["index"])]

    assert tokens(alone[0]) == tokens(alone[1])
    assert all(len(t) == 24 for t in tokens(finals[1]) + tokens(alone[0]))
    assert status["drafter"] == "draft_model" and status["verify_steps"] > 0 and status["accepted_tokens"] > 0, status


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
