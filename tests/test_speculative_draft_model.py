"""The draft-model drafter in the engine core, in this process on the CPU in float32:
with a tiny draft of a tiny transformers target (GQA, tied embeddings), greedy output is
token for token the output without speculation, single and batched, under preemption,
with n > 1 and with a draft cache too small for every sequence, and seeded sampling with
penalties, top-k and top-p repeats itself; the draft's cache follows the accepted tokens
and is empty once every sequence has finished. On the embedded model with its shipped
draft, drafted as the daemon drafts (the graph generator's draft runner, its draft
distributions in the shared region): sampled tokens are distributed as without
speculation, also under a grammar that refuses most draft tokens, the rejection rule
keeps at least as many draft tokens as the coupled draw, and greedy acceptance is above
a floor. A draft with another vocabulary is refused at start."""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest
import torch

from hybridd import exit_codes
from hybridd.config import EMBEDDED_DRAFT_MODEL, EMBEDDED_MODEL
from hybridd.engine.generate import generate
from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.draft_model import DraftModelDrafter
from hybridd.engine.speculation.drafter import Draft
from hybridd.engine.speculation.policy import SpeculationPolicy
from hybridd.engine.speculation.speculator import Speculator
from hybridd.model import load_model
from hybridd.model.tokenizer import load_tokenizer
from hybridd.protocol.messages import SamplingParams, StructuredOutput
from tests.speculation_helpers import ServedDraftModel, build_tiny_draft, repetitive_prompts, run_engine
from tests.test_speculative_sampling import (SIGNIFICANCE, assert_distributed_alike, chi_square_p,
                                             draws_with_and_without)
from tests.test_start_refusals import REFUSAL_BOUND_S, _start
from tests.tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=32, temperature=0.8, top_k=50, top_p=0.95, seed=1234, ignore_eos=True,
                         repetition_penalty=1.05, frequency_penalty=0.1)
# The shipped draft on the embedded model, greedy, k = 4, Shakespeare's own lines as the
# prompt: it kept 0.31 of its draft tokens (1.5 tokens per verify step, k shrinking as
# drafts are rejected) when this test was written.
ACCEPTANCE_FLOOR = 0.2
ACCEPTANCE_LENGTH_FLOOR = 1.3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama 3.2-shaped target (GQA, tied embeddings) and its one-layer draft."""
    path = tmp_path_factory.mktemp("draft-model")
    target = build_tiny_model("llama3_2", path / "target")
    build_tiny_draft(target, path / "draft", layers=1, noise=0.02)
    return load_model(path / "target", dtype=torch.float32), load_model(path / "draft", dtype=torch.float32)


def speculating(draft, k: int = 4, num_blocks: int = 128, block_size: int = 8) -> Speculator:
    # Always speculating: the policy's choice is tested apart, here every step verifies.
    return Speculator(DraftModelDrafter(draft, num_blocks, block_size), k,
                      SpeculationPolicy(k, initial_acceptance=1.0, adaptive=False))


def test_greedy_identical_single_and_batched(models):
    target, draft = models
    prompts = repetitive_prompts((12, 20, 7))
    plain, _ = run_engine(target, prompts, GREEDY)
    for batch, expected in (([prompts[1]], [plain[1]]), (prompts, plain)):
        speculator = speculating(draft)
        got, _ = run_engine(target, batch, GREEDY, speculator)
        assert got == expected
        stats = speculator.stats
        # Drafts kept and drafts cut short both happened: the cache was rolled back.
        assert 0 < stats.accepted_tokens < stats.draft_tokens, stats.to_dict()
        assert not speculator.drafter.cache.seqs  # released as each sequence finished


def test_seeded_sampling_with_penalties_top_k_top_p_repeats_itself(models):
    """Sampled rows keep draft tokens by the rejection rule, so the output is distributed as
    without speculation (the chi-square tests below), not the same tokens; a seeded request
    run again with the same drafts gives the same tokens."""
    target, draft = models
    prompts = repetitive_prompts((10, 16), seed=5)
    speculator = speculating(draft)
    got, _ = run_engine(target, prompts, SAMPLED, speculator)
    again, _ = run_engine(target, prompts, SAMPLED, speculating(draft))
    assert got == again
    assert 0 < speculator.stats.accepted_tokens < speculator.stats.draft_tokens, speculator.stats.to_dict()
    other_seed, _ = run_engine(target, prompts, msgspec.structs.replace(SAMPLED, seed=4321), speculating(draft))
    assert other_seed != got


def test_a_sampled_tokens_logprob_is_that_of_the_token_the_rule_kept(models):
    """Where the rule replaced a row's own draw (a draft token kept, or a residual drawn), the
    row's logprob is the kept token's: each token's logprob equals its entry among the
    row's top alternatives (of the same processed distribution; top_k keeps every token in them)."""
    target, draft = models
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=11, logprobs=True, top_logprobs=20,
                            ignore_eos=True)
    speculator = speculating(draft)
    seqs = [seq for request in generate(target, repetitive_prompts((10, 16), seed=3), params, speculator=speculator)
            for seq in request]
    stats = speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats.to_dict()
    compared = 0
    for seq in seqs:
        assert [entry.token_id for entry in seq.logprobs] == seq.output_token_ids
        for entry in seq.logprobs:
            alternatives = {alt.token_id: alt.logprob for alt in entry.top_logprobs}
            if entry.token_id in alternatives:
                assert entry.logprob == pytest.approx(alternatives[entry.token_id], abs=1e-5)
                compared += 1
    assert compared > 0.8 * sum(len(seq.logprobs) for seq in seqs)


@pytest.mark.parametrize("draft_blocks", [128, 9], ids=["cache-for-all", "cache-for-few"])
def test_identical_under_preemption_and_with_n_sequences(models, draft_blocks):
    """Preempted sequences keep their draft cache (their tokens are kept); forks draft
    apart; a draft cache too small for every sequence drops the least recently drafted."""
    target, draft = models
    prompts = repetitive_prompts((14, 22, 18, 9), seed=6)
    # Greedy: the output is then the one without speculation whatever was drafted where.
    params = SamplingParams(max_tokens=36, temperature=0.0, n=2, ignore_eos=True)
    plain, _ = run_engine(target, prompts, params)
    speculator = speculating(draft, k=5, num_blocks=draft_blocks, block_size=4)
    # Room for few sequences at their longest: decode preempts.
    got, scheduler = run_engine(target, prompts, params, speculator, num_blocks=32, block_size=4)
    assert got == plain
    assert scheduler.num_preemptions > 0
    # Drafts were verified (and, with a cache for every sequence, kept: with one for few,
    # the few greedy drafts here are all rejected).
    assert speculator.stats.drafts > 0
    assert speculator.stats.accepted_tokens > 0 or draft_blocks < 128
    cache = speculator.drafter.cache
    assert not cache.seqs and len(cache._free) == draft_blocks  # every block back


def test_draft_cache_holds_the_kept_tokens_and_distributions_for_sampled_requests(models):
    target, draft = models
    drafter = DraftModelDrafter(draft, 64, 4)
    prompt = repetitive_prompts((9,), seed=2)[0]
    greedy = Sequence("g", prompt, GREEDY)
    sampled = Sequence("s", prompt, SAMPLED)
    first = drafter.propose([greedy, sampled], [4, 3])
    assert [len(d) for d in first] == [4, 3] and first[0].probabilities is None
    probs = first[1].probabilities
    assert probs.shape == (3, draft.config.vocab_size)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert all(float(probs[j, t]) > 0 for j, t in enumerate(first[1].tokens))
    # The target kept the first two draft tokens and drew another: the cache keeps the
    # prompt and the two, drops the rest, and drafts on from the new token.
    greedy.output_token_ids = first[0].tokens[:2] + [5]
    again = drafter.propose([greedy], [4])[0]
    cached = drafter.cache.seqs["g"]
    assert cached.tokens[:len(greedy)] == greedy.token_ids and len(cached.tokens) == len(greedy) + 3
    fresh = DraftModelDrafter(draft, 64, 4).propose([greedy], [4])[0]
    assert again.tokens == fresh.tokens  # as if the rejected tokens had never been drafted


@pytest.fixture(scope="module")
def embedded():
    model = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    text = (EMBEDDED_MODEL / "validation.txt").read_text()
    # A short scene whose lines repeat (as tests/test_speculative_sampling.py's): its
    # tokens' distributions one position apart are told apart by the chi-square test.
    line = "KING:\nFind him, and bring him hither.\n\n"
    scene = tokenizer.encode(line * 3 + "LAFEU:\nI saw the man to-day, if man he be.\n\n" + line)
    return model, [tokenizer.encode(text[a:a + 200]) for a in (0, 5000, 20000)], scene


def shipped_drafter():
    """The shipped draft as the daemon drafts with it: the graph generator's draft runner,
    asked by the context generator's drafter (here in this process, eager), the draft
    distributions read from the region they share."""
    model = load_model(EMBEDDED_DRAFT_MODEL, dtype=torch.float32, max_positions=1024)
    return ServedDraftModel(model, 1024, 16, max_tokens=512, max_batch=64).drafter


def shipped_draft(k: int = 4) -> Speculator:
    return Speculator(shipped_drafter(), k, SpeculationPolicy(k, adaptive=False, initial_acceptance=1.0))


def test_shipped_draft_acceptance_on_the_embedded_model(embedded):
    model, prompts, _ = embedded
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain, _ = run_engine(model, prompts, params, num_blocks=128, block_size=16)
    speculator = shipped_draft()
    got, _ = run_engine(model, prompts, params, speculator, num_blocks=128, block_size=16)
    assert got == plain
    stats = speculator.stats
    assert stats.acceptance_rate >= ACCEPTANCE_FLOOR, stats.to_dict()
    assert stats.mean_acceptance_length >= ACCEPTANCE_LENGTH_FLOOR, stats.to_dict()


def test_sampled_tokens_are_distributed_as_without_speculation(embedded):
    model, _, scene = embedded
    speculator = shipped_draft(3)
    with_speculation, without = draws_with_and_without(model, scene, speculator, requests=4, n=16, tokens=6)
    assert 0 < speculator.stats.accepted_tokens < speculator.stats.draft_tokens, speculator.stats.to_dict()
    assert_distributed_alike(with_speculation, without)
    assert chi_square_p(with_speculation[1], without[2]) < SIGNIFICANCE  # the test has teeth


class CoupledDraft:
    """The shipped draft's tokens without their distributions: verified as a point-mass
    draft is, kept iff the target drew them (its tokens drawn with the target's noise of
    the same seed and position: the coupled draw)."""

    name = "coupled"

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def propose(self, seqs, max_tokens):
        return [Draft(draft.tokens) for draft in self.drafter.propose(seqs, max_tokens)]

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)


def test_rejection_rule_keeps_at_least_as_many_draft_tokens_as_the_coupled_draw(embedded):
    """The shipped draft at temperature 1, k = 4 on every step, 2 prompts x 2 seeded sequences
    x 40 tokens (160 tokens, about 300 draft tokens each way): the rejection rule keeps
    min(1, p/q) of them where the coupled draw keeps those the target drew itself. When
    this was written: 69 of 327 draft tokens kept (0.211, 1.81 tokens per verify step)
    against 55 of 378 (0.146, 1.56); over 4 prompts x 2 x 64 tokens 0.206 against 0.151
    (docs/lab/experiments.md, "speculative_sampling")."""
    model, prompts, _ = embedded
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=seed, n=2, ignore_eos=True) for seed in (3, 4)]
    rates = {}
    for name in ("rejection", "coupled"):
        drafter = shipped_drafter()
        speculator = Speculator(drafter if name == "rejection" else CoupledDraft(drafter), 4,
                                SpeculationPolicy(4, adaptive=False, initial_acceptance=1.0, min_keep=0.0))
        run_engine(model, prompts[:2], params, speculator, num_blocks=128, block_size=16)
        assert speculator.stats.draft_tokens > 200, speculator.stats.to_dict()
        rates[name] = speculator.stats.acceptance_rate
    assert rates["rejection"] >= rates["coupled"], rates


def test_constrained_sampled_tokens_are_distributed_as_without_speculation(embedded):
    """Under a grammar that refuses most of what the draft proposes (lower-case letters and
    spaces), so that drafts are cut and the refused tokens scored by the rule: the tokens
    drawn at each position are distributed as without speculation (as the test above). The
    rule's own handling of a refused token (always rejected, the residual drawn) is checked
    against exact probabilities in tests/test_speculative_sampling.py."""
    from hybridd.engine.grammar import GrammarCompiler

    model, _, scene = embedded
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    structured = StructuredOutput(regex="[a-z ]{12}")
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size, [tokenizer.eos_token_id])
    try:
        grammar = compiler.compile(structured)
        speculator = shipped_draft(3)
        with_speculation, without = draws_with_and_without(model, scene, speculator, requests=4, n=16, tokens=4,
                                                           structured=structured, grammar=grammar)
    finally:
        compiler.close()
    assert 0 < speculator.stats.accepted_tokens < speculator.stats.draft_tokens, speculator.stats.to_dict()
    assert_distributed_alike(with_speculation, without, first=0)


def test_a_draft_with_another_vocabulary_is_refused_at_start(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(EMBEDDED_DRAFT_MODEL, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"vocab_size": 320}))
    done, seconds = _start("--runtime-dir", str(tmp_path / "run"), "--speculative-drafter", "draft_model",
                           "--speculative-draft-model", str(draft))
    assert done.returncode == exit_codes.USAGE, done.stderr
    assert done.stderr.strip() == (f"hybridd: cannot start: speculative_draft_model {draft}: vocab_size 320 is not "
                                   f"the model's 4096 (a draft needs the model's tokenizer)")
    assert seconds < REFUSAL_BOUND_S
    # The same vocabulary size with another tokenizer: refused too.
    (draft / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    done, _ = _start("--runtime-dir", str(tmp_path / "run"), "--speculative-drafter", "draft_model",
                     "--speculative-draft-model", str(draft))
    assert done.returncode == exit_codes.USAGE, done.stderr
    assert done.stderr.strip().endswith("its tokenizer is not the model's "
                                        f"({EMBEDDED_MODEL}): a draft needs the model's tokenizer"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
