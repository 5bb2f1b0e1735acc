"""The draft-model drafter through the two real worker processes: the daemon with
speculative_drafter draft_model (the embedded model's shipped draft, in the context
generator) gives the in-process engine's output without speculation, greedy alone and
seeded n > 1 beside it, and its status counts the draft model's verified drafts."""

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

pytestmark = pytest.mark.slow
DEVICE = os.environ.get("HYBRIDD_TEST_DEVICE", "cpu")
K = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("draft"), device=DEVICE, dtype="float32",
                    speculative_drafter="draft_model", num_speculative_tokens=K, max_batch=8) as engine:
        yield engine


def test_draft_model_in_the_daemon_equals_the_engine_without_speculation(pair):
    model = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
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
        status = client.request({"type": "status"})["status"]["speculation"]
    finally:
        client.close()
    (plain_greedy,), (plain_sampled,) = (generate(model, [p], SamplingParams(**s))
                                          for p, s in ((prompts[0], greedy), (prompts[1], sampled)))
    assert finals[0]["choices"][0]["token_ids"] == list(plain_greedy[0].output_token_ids)
    got = [c["token_ids"] for c in sorted(finals[1]["choices"], key=lambda c: c["index"])]
    assert got == [list(seq.output_token_ids) for seq in plain_sampled]
    # Drafts were verified (the policy then keeps speculating only where it measured cheaper
    # per token, so how many is its choice; acceptance is measured in process).
    assert status["drafter"] == "draft_model" and status["verify_steps"] > 0 and status["draft_tokens"] > 0, status
