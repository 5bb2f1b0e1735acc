"""The EAGLE-3 drafter through the two real worker processes: the graph generator writes
the model's hidden states in the head's layers into the shared step buffers, the context
generator hands them to the head, and the daemon with speculative_drafter eagle3 gives
the in-process engine's output without speculation, greedy alone and seeded n > 1 beside
it, with drafts verified. The head is a random one in the published format, for the
embedded model (`tests/eagle3_reference.py`). A head whose KV cache cannot fit beside the
weights is refused at start, naming it."""

from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import AutoConfig

from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.generate import generate
from hybridd.model import load_model
from hybridd.model.tokenizer import load_tokenizer
from hybridd.protocol.messages import SamplingParams
from tests.eagle3_reference import ReferenceEagle3, head_config
from tests.engine_pair import EnginePair
from tests.host_load import on_this_host
from tests.test_start_refusals import refused_at_start

pytestmark = pytest.mark.slow
DEVICE = os.environ.get("HYBRIDD_TEST_DEVICE", "cpu")
K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3")
    torch.manual_seed(5)
    head = ReferenceEagle3(head_config(AutoConfig.from_pretrained(EMBEDDED_MODEL), hidden=64, intermediate=128,
                                       draft_vocab=1024), d2t=torch.arange(1024) * 3 % 4096 - torch.arange(1024))
    head.save_head(path / "head")
    (path / "run").mkdir()
    with EnginePair(path / "run", device=DEVICE, dtype="float32", speculative_drafter="eagle3",
                    speculative_eagle3_head=str(path / "head"), num_speculative_tokens=K, max_batch=8) as engine:
        yield engine


def test_eagle3_in_the_daemon_equals_the_engine_without_speculation(pair):
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
        # The head's KV arena and graphs, from the graph generator's counters (sent about once a second).
        deadline = time.monotonic() + on_this_host(30)
        while True:
            status = client.request({"type": "status"})["status"]["speculation"]
            if "eagle3" in status or time.monotonic() > deadline:
                break
            client.request({"type": "health"}, timeout=0.2)  # a round trip between looks
    finally:
        client.close()
    (plain_greedy,), (plain_sampled,) = (generate(model, [p], SamplingParams(**s))
                                          for p, s in ((prompts[0], greedy), (prompts[1], sampled)))
    assert finals[0]["choices"][0]["token_ids"] == list(plain_greedy[0].output_token_ids)
    got = [c["token_ids"] for c in sorted(finals[1]["choices"], key=lambda c: c["index"])]
    assert got == [list(seq.output_token_ids) for seq in plain_sampled]
    assert status["drafter"] == "eagle3" and status["verify_steps"] > 0 and status["draft_tokens"] > 0, status
    assert status["eagle3"]["buckets"], status  # the head's steps, run by the graph generator


def test_a_head_whose_kv_cache_cannot_fit_is_refused_at_start(tmp_path):
    # The device's free memory as the graph generator reads it: less than the head's KV cache.
    error = refused_at_start(tmp_path, "--speculative-drafter", "eagle3",
                             env={"HYBRIDD_TEST_FREE_MEMORY_BYTES": str(1 << 20)})
    assert "speculative_eagle3_head" in error and "its KV cache of" in error, error
