"""Speculative decoding in the engine core, in this process on the CPU in float32: the
output is token for token the output without speculation (greedy, and seeded sampling,
whose draws are keyed by seed and position), with the n-gram drafter and with a drafter
that is right and wrong at set places; single and batched, under preemption, with n > 1.
Rows of rejected drafts leave no trace: the prefix cache and the KV blocks hold
accepted tokens only."""

from __future__ import annotations

import pytest
import torch

from hybridd.engine.speculation.ngram import NgramDrafter
from hybridd.engine.speculation.policy import SpeculationPolicy
from hybridd.engine.speculation.speculator import Speculator
from hybridd.model import load_model
from hybridd.protocol.messages import SamplingParams
from tests.speculation_helpers import ReplayDrafter, repetitive_prompts, run_engine
from tests.tiny_models import build_tiny_model

# GQA (4 heads over 2 KV heads) in all; Llama 3 RoPE; tied embeddings with Llama 3.2's RoPE; Qwen2's biases.
ARCHS = ("llama", "llama3", "llama3_2", "qwen2")
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=32, temperature=0.8, top_k=50, top_p=0.95, seed=1234, ignore_eos=True,
                         repetition_penalty=1.05, frequency_penalty=0.1)


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"spec-{request.param}")
    build_tiny_model(request.param, path)
    return load_model(path, dtype=torch.float32)


def ngram(k: int = 4) -> Speculator:
    # Always speculating: the policy's choice is tested apart, here every step verifies.
    return Speculator(NgramDrafter(1, 3), k, SpeculationPolicy(k, initial_acceptance=0.9, adaptive=False))


def test_greedy_identical_with_ngram_single_and_batched(model):
    prompts = repetitive_prompts((12, 20, 7))
    plain, _ = run_engine(model, prompts, GREEDY)
    for batch in ([prompts[0]], prompts):
        speculator = ngram()
        got, _ = run_engine(model, batch, GREEDY, speculator)
        assert got == plain[:len(batch)]
        stats = speculator.stats
        assert stats.verify_steps > 0 and stats.accepted_tokens > 0, stats.to_dict()


def test_greedy_identical_when_drafts_are_right_and_wrong(model):
    prompts = repetitive_prompts((9, 15, 30), seed=4)
    plain, _ = run_engine(model, prompts, GREEDY)
    drafter = ReplayDrafter(prompts, plain, wrong_every=4)
    speculator = Speculator(drafter, 5, SpeculationPolicy(5, initial_acceptance=1.0, adaptive=False))
    got, _ = run_engine(model, prompts, GREEDY, speculator)
    assert got == plain
    stats = speculator.stats.to_dict()
    # Drafts kept whole, cut short and rejected at once all happened.
    assert stats["accepted_per_position"][0] > stats["accepted_per_position"][2] > 0, stats
    assert stats["drafts"] > stats["accepted_per_position"][0], stats


def test_seeded_sampling_identical_with_penalties_top_k_top_p(model):
    prompts = repetitive_prompts((10, 16), seed=5)
    plain, _ = run_engine(model, prompts, SAMPLED)
    drafter = ReplayDrafter(prompts, plain, wrong_every=3)
    speculator = Speculator(drafter, 4, SpeculationPolicy(4, initial_acceptance=1.0, adaptive=False))
    got, _ = run_engine(model, prompts, SAMPLED, speculator)
    assert got == plain
    assert speculator.stats.accepted_tokens > 0
    again, _ = run_engine(model, prompts, SAMPLED, ngram())
    assert again == plain


def test_identical_under_preemption_and_with_n_sequences(model):
    prompts = repetitive_prompts((14, 22, 18, 9), seed=6)
    params = SamplingParams(max_tokens=36, temperature=0.7, seed=99, n=2, ignore_eos=True)
    plain, _ = run_engine(model, prompts, params)
    drafter = ReplayDrafter(prompts, plain, wrong_every=5)
    speculator = Speculator(drafter, 6, SpeculationPolicy(6, initial_acceptance=1.0, adaptive=False))
    # Room for few sequences at their longest: decode preempts, and the drafts' blocks are short.
    got, scheduler = run_engine(model, prompts, params, speculator, num_blocks=32, block_size=4)
    assert got == plain
    assert scheduler.num_preemptions > 0
    assert speculator.stats.accepted_tokens > 0
    assert scheduler.block_manager.num_free == scheduler.block_manager.num_blocks


def test_prefix_cache_holds_only_accepted_tokens(model):
    """A second request whose prompt is the first's prompt and output reuses the cached
    blocks and decodes the same tokens: a block keyed by accepted tokens holds their KV,
    not a rejected draft's."""
    prompt = repetitive_prompts((20,), seed=8)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    speculator = ngram()
    (first,), _ = run_engine(model, [prompt], params, speculator)
    assert speculator.stats.draft_tokens > speculator.stats.accepted_tokens  # some drafts were rejected
    continued = prompt + first[0]
    plain, _ = run_engine(model, [continued], params)
    from hybridd.engine.block_manager import BlockManager
    from hybridd.engine.core import EngineCore
    from hybridd.engine.in_process_runner import InProcessRunner
    from hybridd.engine.scheduler import Scheduler
    from hybridd.model.kv_cache import KVCache

    kv = KVCache.allocate(model.config, 65, 4, model.dtype, model.device)
    blocks = BlockManager(64, 4, watermark=0.0)
    scheduler = Scheduler(blocks, max_batch=2, max_prefill_tokens=512, max_model_len=model.max_positions,
                          speculator=ngram(), max_verify_rows=10)
    core = EngineCore(scheduler, InProcessRunner(model, kv), pipeline_depth=1)
    core.add("a", prompt, params)
    while core.has_work:
        core.step()
    second = core.add("b", continued, params)
    while core.has_work:
        core.step()
    assert second.cached_tokens > len(prompt)  # blocks written by verify steps were reused
    assert list(second.seqs[0].output_token_ids) == plain[0][0]


def test_stops_logprobs_and_max_tokens_inside_a_kept_draft(model):
    """A stop token inside a kept draft ends the sequence there (the rest is dropped),
    each kept token's logprobs are its own row's, and no draft runs past max_tokens."""
    prompts = repetitive_prompts((16, 24), seed=9)
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    plain, _ = run_engine(model, prompts, base)
    stop = plain[0][0][12]
    for params in (base, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
                   SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)):
        expected, _ = run_engine(model, prompts, params)
        drafter = ReplayDrafter(prompts, plain, wrong_every=6)
        speculator = Speculator(drafter, 5, SpeculationPolicy(5, initial_acceptance=1.0, adaptive=False))
        got, scheduler = run_engine(model, prompts, params, speculator)
        assert got == expected
        assert speculator.stats.accepted_tokens > 0
    assert len(expected[0][0]) == 7


def test_logprobs_of_kept_drafts_equal_those_without_speculation(model):
    from hybridd.engine.generate import generate

    prompt = repetitive_prompts((20,), seed=10)[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    (plain,) = generate(model, [prompt], params)
    drafter = ReplayDrafter([prompt], [[list(plain[0].output_token_ids)]], wrong_every=4)
    speculator = Speculator(drafter, 4, SpeculationPolicy(4, initial_acceptance=1.0, adaptive=False))
    (got,) = generate(model, [prompt], params, speculator=speculator)
    assert got[0].output_token_ids == plain[0].output_token_ids
    assert speculator.stats.accepted_tokens > 0
    for mine, theirs in zip(got[0].logprobs, plain[0].logprobs, strict=True):
        assert mine.token_id == theirs.token_id
        assert abs(mine.logprob - theirs.logprob) < 1e-4
        assert [t.token_id for t in mine.top_logprobs] == [t.token_id for t in theirs.top_logprobs]
