"""Speculative sampling keeps the target's distribution: on the embedded model, the
tokens drawn over many seeds with speculation are distributed as those drawn without
(a two-sample chi-square test at significance 0.001, on seeds disjoint from each other,
so that the test does not lean on the draws being coupled by seed); the general
rejection rule for drafts with a distribution (a draft model's) against exact
probabilities (goodness of fit, same significance); and prompt lookup's acceptance on a
prompt-grounded task above a floor.
Seeds are fixed, so each test's statistic is the same at every run."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.speculation.ngram import NgramDrafter
from hybridd.engine.speculation.policy import SpeculationPolicy
from hybridd.engine.speculation.speculator import Speculator
from hybridd.engine.speculation.verification import rejection_rule
from hybridd.model import load_model
from hybridd.model.tokenizer import load_tokenizer
from hybridd.protocol.messages import SamplingParams
from tests.speculation_helpers import sampled_tokens_by_position, run_engine

SIGNIFICANCE = 1e-3
# Greedy prompt lookup on the grounded prompt below kept 0.71 of its draft tokens (k 2 to 6)
# and gained 2.1 to 2.6 tokens per verify step when this test was written.
ACCEPTANCE_FLOOR = 0.5
ACCEPTANCE_LENGTH_FLOOR = 1.8


def chi_square_p(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """p-value of the two-sample chi-square test that `a` and `b` (counts per category)
    come from one distribution; categories expected below `min_expected` are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    cells, rare = [], [0, 0]
    for key in set(a) | set(b):
        total = a[key] + b[key]
        if min(total * na, total * nb) / (na + nb) < min_expected:
            rare[0] += a[key]
            rare[1] += b[key]
        else:
            cells.append((a[key], b[key]))
    if sum(rare):
        cells.append(tuple(rare))
    stat = 0.0
    for ca, cb in cells:
        total = ca + cb
        for count, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    df = len(cells) - 1
    if df < 1:
        return 1.0  # one category: nothing tells the samples apart
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def embedded():
    model = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    passage = (EMBEDDED_MODEL / "validation.txt").read_text()[:600]
    # The passage, then its beginning again: the model continues a text its prompt holds.
    # A short scene whose lines repeat: many draws after kept drafts, in few steps.
    line = "KING:\nFind him, and bring him hither.\n\n"
    scene = line * 3 + "LAFEU:\nI saw the man to-day, if man he be.\n\n" + line
    return model, tokenizer.encode(passage + "\n\n" + passage[:200]), tokenizer.encode(scene)


def always(k: int) -> Speculator:
    return Speculator(NgramDrafter(1, 4), k, SpeculationPolicy(k, adaptive=False, initial_acceptance=0.9))


def draws_with_and_without(model, prompt: list[int], speculator: Speculator, requests: int, n: int, tokens: int,
                           structured=None, grammar=None) -> tuple[list[Counter], list[Counter]]:
    """The tokens drawn at each position (`sampled_tokens_by_position`) with `speculator`
    and without speculation, on seeds disjoint between the two runs, so that the test does
    not lean on the draws being coupled by seed."""
    with_speculation = sampled_tokens_by_position(model, prompt, speculator, 10_000, requests, n, tokens,
                                                  structured, grammar)
    without = sampled_tokens_by_position(model, prompt, None, 0, requests, n, tokens, structured, grammar)
    return with_speculation, without


def assert_distributed_alike(with_speculation: list[Counter], without: list[Counter], first: int = 1) -> None:
    """The draws at each position from `first` on (1: those after kept drafts) pass the
    two-sample chi-square test at SIGNIFICANCE."""
    for position in range(first, len(without)):
        p = chi_square_p(with_speculation[position], without[position])
        assert p > SIGNIFICANCE, (position, p)


def test_sampled_tokens_are_distributed_as_without_speculation(embedded):
    model, _, prompt = embedded
    speculator = always(4)
    with_speculation, without = draws_with_and_without(model, prompt, speculator, requests=4, n=16, tokens=6)
    assert speculator.stats.accepted_tokens > 0.2 * speculator.stats.drafts  # drafts were kept, and cut
    assert speculator.stats.accepted_tokens < speculator.stats.draft_tokens
    assert_distributed_alike(with_speculation, without)
    # The test has teeth: the draws one position apart are told apart.
    assert chi_square_p(with_speculation[1], without[2]) < SIGNIFICANCE


def goodness_of_fit_p(counts: Counter, probs: torch.Tensor) -> float:
    """p-value of the chi-square test that `counts` were drawn from `probs` (categories of
    probability 0 must have no count: any is a failure, p-value 0)."""
    trials = sum(counts.values())
    if any(float(probs[token]) == 0.0 for token in counts):
        return 0.0
    support = [i for i in range(probs.shape[0]) if float(probs[i]) > 0]
    stat = sum((counts[i] - trials * float(probs[i])) ** 2 / (trials * float(probs[i])) for i in support)
    return float(torch.special.gammaincc(torch.tensor((len(support) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("case", ["dense", "grammar_refuses_drafted_token", "point_mass"])
def test_rejection_rule_gives_the_target_distribution_exactly(case):
    """Draft tokens drawn from q, kept with probability min(1, p/q), else redrawn from
    norm(max(p - q, 0)) (`rejection_rule`, one row per seed): the tokens are distributed
    as p (chi-square goodness of fit at significance 0.001, 4000 rows), including where
    p is 0 on tokens q drafts (a grammar's mask), and for a point-mass draft."""
    vocab, trials = 6, 4000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    if case == "grammar_refuses_drafted_token":
        q[0] = q.max() * 2  # the draft favours token 0 ...
        q /= q.sum()
        p[0] = 0.0  # ... which the grammar refuses
        p /= p.sum()
    draft = torch.multinomial(q, trials, replacement=True, generator=g)
    if case == "point_mass":
        draft = torch.full((trials,), 2)
        q = torch.nn.functional.one_hot(torch.tensor(2), vocab).float()
    seeds = torch.arange(trials, dtype=torch.int64) * 7919
    positions = torch.full((trials,), 7, dtype=torch.int64)
    tokens = rejection_rule(p.expand(trials, -1), q.expand(trials, -1), draft, seeds, positions)
    counts = Counter(tokens.tolist())
    assert goodness_of_fit_p(counts, p) > SIGNIFICANCE, (counts, p)
    kept = int((tokens == draft).sum())
    expected = float(torch.minimum(p, q).sum()) * trials  # the chance a draft token is kept is sum min(p, q)
    assert abs(kept - expected) < 4 * (expected * (1 - expected / trials)) ** 0.5 + 1, (kept, expected)
    assert 0 < kept < trials  # drafts were kept, and redrawn
    # The same seeds and positions give the same tokens; other positions other ones.
    assert torch.equal(tokens, rejection_rule(p.expand(trials, -1), q.expand(trials, -1), draft, seeds, positions))
    assert not torch.equal(tokens, rejection_rule(p.expand(trials, -1), q.expand(trials, -1), draft, seeds,
                                                  positions + 1))


def test_prompt_lookup_acceptance_on_a_grounded_prompt(embedded):
    model, prompt, _ = embedded
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain, _ = run_engine(model, [prompt], params, max_batch=1, num_blocks=128, block_size=16)
    speculator = always(4)
    got, _ = run_engine(model, [prompt], params, speculator, max_batch=1, num_blocks=128, block_size=16)
    assert got == plain
    stats = speculator.stats
    assert stats.acceptance_rate >= ACCEPTANCE_FLOOR, stats.to_dict()
    assert stats.mean_acceptance_length >= ACCEPTANCE_LENGTH_FLOOR, stats.to_dict()
