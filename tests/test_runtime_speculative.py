"""Speculative decoding through the two real worker processes (shared memory, the step
pipeline, the graph generator's steps): the output equals the in-process engine's
without speculation, alone, batched and with n > 1 seeded sequences; structured output
(a JSON schema, a regex) is drafted for and gives the greedy output without speculation,
valid; a version 4 request turns it off for itself; status and /metrics count the drafts."""

from __future__ import annotations

import os

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.generate import generate
from hybridd.metrics import render
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
    with EnginePair(tmp_path_factory.mktemp("spec"), device=DEVICE, dtype="float32", speculative_drafter="ngram",
                    num_speculative_tokens=K, max_batch=8) as engine:
        yield engine


@pytest.fixture
def client(pair):
    c = pair.client(version=4)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference():
    model = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    text = (EMBEDDED_MODEL / "validation.txt").read_text()
    prompts = [tokenizer.encode(text[a:a + 300] + "\n\n" + text[a:a + 80]) for a in (0, 700, 1500)]

    def plain(prompt_ids: list[int], params: SamplingParams) -> list[list[int]]:
        (seqs,) = generate(model, [prompt_ids], params)
        return [list(seq.output_token_ids) for seq in seqs]

    return prompts, plain


def speculation(client) -> dict:
    return client.request({"type": "status"})["status"]["speculation"]


def test_greedy_equals_the_engine_without_speculation(client, reference):
    prompts, plain = reference
    before = speculation(client)
    expected = plain(prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    # The policy speculates where it measured that cheaper, and probes it a few steps in 64
    # elsewhere: requests see verify steps either way, and each probe's first draft token is
    # kept about 4 times in 10 here, so up to 24 requests (stopping at the first accepted
    # token) make a miss about as likely as 0.6 ** 24.
    for _ in range(24):
        final, chunks = client.generate(prompt_token_ids=prompts[0], sampling={"max_tokens": 40, "temperature": 0.0,
                                                                               "ignore_eos": True})
        assert final["choices"][0]["token_ids"] == expected
        assert [t for c in chunks for t in c["token_ids"]] == expected  # one chunk per token, in order
        assert final["usage"]["completion_tokens"] == 40
        after = speculation(client)
        if after["accepted_tokens"] > before["accepted_tokens"]:
            break
    assert after["drafter"] == "ngram" and after["drafts"] > before["drafts"], after
    assert after["accepted_tokens"] > before["accepted_tokens"], after
    assert len(after["accepted_per_position"]) == K


def test_batched_and_n_sequences_equal_the_engine(client, reference):
    prompts, plain = reference
    greedy = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    sampled = {"max_tokens": 24, "temperature": 0.8, "top_k": 40, "seed": 7, "n": 2, "ignore_eos": True}
    ids = [client.send({"type": "generate", "prompt_token_ids": p, "sampling": greedy, "stream": False})
           for p in prompts]
    ids.append(client.send({"type": "generate", "prompt_token_ids": prompts[1], "sampling": sampled,
                            "stream": False}))
    finals = [client.collect(rid)[0] for rid in ids]
    for prompt, final in zip(prompts, finals, strict=False):
        assert final["choices"][0]["token_ids"] == plain(prompt, SamplingParams(**greedy))[0]
    got = [choice["token_ids"] for choice in sorted(finals[-1]["choices"], key=lambda c: c["index"])]
    assert got == plain(prompts[1], SamplingParams(**sampled))


@pytest.fixture(scope="module")
def embedded():
    return load_model(EMBEDDED_MODEL, dtype=torch.float32), load_tokenizer(EMBEDDED_MODEL)


@pytest.mark.parametrize("case", sorted(STRUCTURED_CASES))
def test_structured_output_is_drafted_for_and_equals_the_engine_without_speculation(client, embedded, case):
    model, tokenizer = embedded
    expected = structured_without_speculation(model, tokenizer, case)
    # The policy speculates where it measured that cheaper and probes it elsewhere (see the
    # greedy test above): the request is sent until one of its runs was drafted for.
    for _ in range(24):
        before = speculation(client)
        got, text, finish_reason = structured_through_daemon(client, tokenizer, case)
        assert got == expected
        assert finish_reason == "stop" and valid_structured_output(case, text), text
        if speculation(client)["draft_tokens"] > before["draft_tokens"]:
            break
    assert speculation(client)["draft_tokens"] > before["draft_tokens"]


def test_a_request_turns_it_off_for_itself(client, reference, pair):
    prompts, plain = reference
    sampling = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    before = speculation(client)
    final, _ = client.generate(prompt_token_ids=prompts[2], sampling=sampling, speculative=False)
    assert final["choices"][0]["token_ids"] == plain(prompts[2], SamplingParams(**sampling))[0]
    assert speculation(client)["draft_tokens"] == before["draft_tokens"]
    refused, _ = client.generate(prompt_token_ids=prompts[2], sampling=sampling, speculative="off")
    assert (refused["type"], refused["code"], refused["field"]) == ("error", "invalid_request", "speculative")
    status = client.request({"type": "status"})["status"]
    text = render(status, "tiny").decode()
    for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 'spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}'):
        assert f"hybridd:{name}" in text, name
