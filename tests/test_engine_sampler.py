"""Sampler: greedy, filtered distribution vs. a float64 reference, empirical
frequencies, seed reproducibility across batches, compiled == eager."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from hybridd.engine.sampler import Sampler, SamplingTensors, gumbel_noise
from hybridd.protocol.messages import SamplingParams

V = 40


def build(params, seeds=None, positions=None, prompts=None, outputs=None):
    n = len(params)
    return SamplingTensors.build(
        params,
        seeds if seeds is not None else list(range(n)),
        positions if positions is not None else [0] * n,
        V,
        "cpu",
        prompts if prompts is not None else [[0]] * n,
        outputs if outputs is not None else [[]] * n,
    )


def reference_probs(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The distribution a row should sample from, computed independently in float64."""
    x = logits.double().clone()
    counts = [0] * V
    for t in output:
        counts[t] += 1
    for t in range(V):
        seen = counts[t] > 0 or t in prompt
        if seen and p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    if p.temperature == 0:
        probs = torch.zeros(V, dtype=torch.float64)
        probs[int(x.argmax())] = 1.0
        return probs
    x = x / p.temperature
    order = sorted(range(V), key=lambda t: -float(x[t]))
    k = p.top_k if 0 < p.top_k < V else V
    kept = order[:k]
    w = torch.exp(x[kept] - x[kept].max())
    w = w / w.sum()
    nucleus, mass = [], 0.0
    for t, prob in zip(kept, w.tolist()):
        if mass >= p.top_p and p.top_p < 1.0:
            break
        nucleus.append(t)
        mass += prob
    probs = torch.zeros(V, dtype=torch.float64)
    z = torch.exp(x[nucleus] - x[nucleus].max())
    probs[nucleus] = z / z.sum()
    return probs


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.8, repetition_penalty=1.4),
    SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0),
]
PROMPTS = [[1, 2], [3], [4, 5, 6], [7, 8, 1], [9], [2, 3, 4]]
OUTPUTS = [[], [3, 3], [10], [7, 11, 11], [12, 12, 12, 13], [2, 14]]


def test_greedy_is_argmax_and_writes_out():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(0))
    out = torch.full((8,), -1, dtype=torch.int64)
    tokens = Sampler(compile=False)(logits, build([SamplingParams(temperature=0.0)] * 8), out=out)
    assert tokens is out
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_rows_in_a_sampled_batch_take_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.9)] * 2
    tokens = Sampler(compile=False)(logits, build(params))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_processed_distribution_matches_float64_reference():
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(2)) * 3
    t = build(PARAMS, prompts=PROMPTS, outputs=OUTPUTS)
    processed = Sampler.processed_logits(logits, t)
    for row, p in enumerate(PARAMS):
        expected = reference_probs(logits[row], p, PROMPTS[row], OUTPUTS[row])
        if p.temperature == 0:
            assert int(processed[row].argmax()) == int(expected.argmax())
            continue
        got = processed[row].double().softmax(dim=-1)
        assert torch.equal(got > 0, expected > 0), f"row {row}: support differs"
        assert torch.allclose(got, expected, atol=1e-5), f"row {row}"


@pytest.mark.parametrize("row", range(5))
def test_empirical_frequencies_match_reference(row):
    """Many draws of one request (same seed, successive positions) follow the reference."""
    n = 20_000
    p = PARAMS[row]
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    t = build([p] * n, [987] * n, list(range(n)), [PROMPTS[row]] * n, [OUTPUTS[row]] * n)
    tokens = Sampler(compile=False)(logits.expand(n, V), t)
    freq = torch.bincount(tokens, minlength=V).double() / n
    expected = reference_probs(logits, p, PROMPTS[row], OUTPUTS[row])
    assert bool((freq[expected == 0] == 0).all()), "sampled a token outside top-k / top-p"
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool((freq - expected).abs().le(5 * sigma + 2e-3).all()), (freq - expected).abs().max()
    # Pearson chi-square over the support, against a generous critical value.
    support = expected > 0
    chi2 = float((((freq - expected)[support] * n) ** 2 / (expected[support] * n)).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10


def test_top_k_and_top_p_never_leave_their_set():
    gen = torch.Generator().manual_seed(4)
    n = 2000
    logits = torch.randn(n, V, generator=gen) * 4
    half = n // 2
    params = [SamplingParams(temperature=2.0, top_k=3)] * half + [SamplingParams(temperature=2.0, top_p=0.3)] * half
    tokens = Sampler(compile=False)(logits, build(params, seeds=list(range(n))))
    for row in range(n):
        expected = reference_probs(logits[row], params[row], [0], [])
        assert expected[tokens[row]] > 0


def test_seeded_row_is_independent_of_batch_composition_and_row():
    gen = torch.Generator().manual_seed(5)
    target = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1234)
    target_logits = torch.randn(30, V, generator=gen)  # one step per position
    others = [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_p=0.5),
    ]
    sampler = Sampler(compile=False)

    def run(row: int, batch_params: list[SamplingParams]) -> list[int]:
        tokens = []
        for pos in range(30):
            params = list(batch_params)
            params.insert(row, target)
            logits = torch.randn(len(params), V, generator=gen)
            logits[row] = target_logits[pos]
            seeds = [int(x) for x in torch.randint(0, 2**62, (len(params),), generator=gen)]
            seeds[row] = target.seed
            t = build(params, seeds=seeds, positions=[pos] * len(params))
            tokens.append(int(sampler(logits, t)[row]))
        return tokens

    alone = run(0, [])
    assert run(2, others) == alone
    assert run(1, others[::-1] + others) == alone
    assert len(set(alone)) > 3


def test_different_seeds_give_different_streams():
    logits = torch.zeros(8, V)  # uniform: every difference comes from the noise
    sampler = Sampler(compile=False)
    streams = []
    for seed in range(8):
        t = build([SamplingParams(temperature=1.0)] * 8, seeds=[seed] * 8, positions=list(range(8)))
        streams.append(tuple(sampler(logits, t).tolist()))
    assert len(set(streams)) == 8


def test_noise_is_standard_gumbel():
    g = gumbel_noise(torch.tensor([7, -3, 2**62]), torch.tensor([0, 5, 10**6]), 50_000).double()
    assert torch.isfinite(g).all()
    for row in g:
        assert abs(float(row.mean()) - 0.5772) < 0.03  # Euler-Mascheroni
        assert abs(float(row.var()) - math.pi**2 / 6) < 0.1


def test_record_counts_tokens_on_device():
    params = [SamplingParams(temperature=1.0, frequency_penalty=0.5, seed=1)] * 2
    t = build(params, seeds=[1, 2], positions=[3, 9], prompts=[[1], [2]], outputs=[[4], []])
    t.record(torch.tensor([4, 6]))
    rebuilt = build(params, seeds=[1, 2], positions=[3, 9], prompts=[[1], [2]], outputs=[[4, 4], [6]])
    assert torch.equal(t.positions, rebuilt.positions)
    assert torch.equal(t.output_counts, rebuilt.output_counts)
    # Only the rows whose token is in flight: the second row's token is already counted.
    t.record(torch.tensor([7, 6]), torch.tensor([True, False]))
    rebuilt = build(params, seeds=[1, 2], positions=[3, 9], prompts=[[1], [2]], outputs=[[4, 4, 7], [6]])
    assert torch.equal(t.output_counts, rebuilt.output_counts)


def test_compiled_matches_eager():
    gen = torch.Generator().manual_seed(6)
    prompts, outputs = PROMPTS * 2, OUTPUTS * 2
    params = PARAMS * 2
    compiled, eager = Sampler(compile=True), Sampler(compile=False)
    for batch in (12, 5):  # a second shape must not recompile into a wrong kernel
        t = build(params[:batch], seeds=list(range(batch)), positions=list(range(batch)),
                  prompts=prompts[:batch], outputs=outputs[:batch])
        for _ in range(3):
            logits = torch.randn(batch, V, generator=gen) * 3
            assert torch.equal(compiled(logits, t), eager(logits, t))
            t.record(eager(logits, t))
            t.positions.add_(1)
    greedy = build([SamplingParams(temperature=0.0, presence_penalty=1.0)] * 3, prompts=[[1]] * 3, outputs=[[2]] * 3)
    logits = torch.randn(3, V, generator=gen)
    assert torch.equal(compiled(logits, greedy), eager(logits, greedy))


def reference_logprobs(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logprobs of the distribution a row samples from, as OpenAI defines them: after the
    penalties, the temperature and the top-k/top-p cut; greedy rows are unscaled."""
    if p.temperature > 0:
        return reference_probs(logits, p, prompt, output).log()
    penalised = reference_probs(logits, msgspec.structs.replace(p, temperature=1.0, top_k=0, top_p=1.0),
                                prompt, output)
    return penalised.log()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_logprobs_follow_the_sampled_distribution(compile):
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(7)) * 3
    t = build(PARAMS, prompts=PROMPTS, outputs=OUTPUTS)
    sampler = Sampler(compile=compile)
    tokens = sampler(logits, t)
    lp = sampler.logprobs(logits, t, tokens)
    assert lp.top_ids.shape == (len(PARAMS), 20) and lp.top_values.shape == (len(PARAMS), 20)
    for row, p in enumerate(PARAMS):
        expected = reference_logprobs(logits[row], p, PROMPTS[row], OUTPUTS[row])
        token = int(tokens[row])
        assert math.isfinite(float(lp.sampled[row])), f"row {row}: the sampled token has no mass"
        assert float(lp.sampled[row]) == pytest.approx(float(expected[token]), abs=1e-4), f"row {row}"
        values = lp.top_values[row].double()
        assert torch.all(values[:-1] >= values[1:]), "most likely first"
        finite = torch.isfinite(values)
        ids = lp.top_ids[row][finite]
        assert torch.allclose(values[finite], expected[ids], atol=1e-4), f"row {row}"
        # the alternatives are the most likely tokens: none outside them beats the last one
        assert float(expected.max()) == pytest.approx(float(values[0]), abs=1e-4)
        rest = expected.clone()
        rest[lp.top_ids[row]] = float("-inf")
        assert float(rest.max()) <= float(values[-1]) + 1e-4


def test_fused_kernels_take_unaligned_tensors():
    """Logits and an output row at any alignment (a ring of odd width, logits one
    element into their buffer): the fused path copies them to aligned tensors, so the
    kernels see the warm-up's alignment, and draws the eager tokens. (On the GPU,
    tests/test_gpu_sampler.py checks that such tensors compile nothing new.)"""
    pytest.importorskip("triton")
    from tests.triton_target import CUDA, require_triton

    require_triton()
    if CUDA:
        pytest.skip("the interpreter's check; the GPU has its own in tests/test_gpu_sampler.py")
    fused, eager = Sampler(compile=True), Sampler(compile=False)
    n = len(PARAMS)
    t = build(PARAMS, prompts=PROMPTS, outputs=OUTPUTS)
    flat = torch.randn(n * V + 1, generator=torch.Generator().manual_seed(8)) * 3
    logits = flat[1:].view(n, V)
    ring = torch.full((2, n + 1), -1, dtype=torch.int64)
    out = ring[1, :n]
    assert out.data_ptr() % 16 != 0 and logits.data_ptr() % 16 != 0
    got = fused(logits, t, out=out)
    assert got is out and torch.equal(out, eager(logits, t))
    assert torch.equal(ring[0], torch.full((n + 1,), -1, dtype=torch.int64))


def test_fused_kernels_across_vocabulary_blocks():
    """A vocabulary of several kernel blocks with a partial last one: the blocks' maxima
    merge to the eager tokens, ties go to the first index across blocks, and the
    top-k/top-p cut, the penalties and the logprobs span the blocks."""
    pytest.importorskip("triton")
    from hybridd.engine.sampling_kernels import BLOCK
    from tests.triton_target import CUDA, require_triton

    require_triton()
    if CUDA:
        pytest.skip("the interpreter's check; tests/test_gpu_sampler.py covers both vocabularies on the GPU")
    vocab = 2 * BLOCK + 37
    fused, eager = Sampler(compile=True), Sampler(compile=False)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.9, top_k=3000, seed=2),
        SamplingParams(temperature=1.3, top_p=0.95, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7),
        SamplingParams(temperature=0.8, frequency_penalty=0.4, top_p=0.7, seed=4),
    ]
    n = len(params)
    history = [[5, BLOCK + 1, 2 * BLOCK + 36]] * n
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        t = SamplingTensors.build(params, [p.seed or 0 for p in params], [step] * n, vocab, "cpu", history, history)
        logits = torch.randn(n, vocab, generator=g) * 2
        tokens = eager(logits, t)
        assert torch.equal(fused(logits, t), tokens)
        got, want = fused.logprobs(logits, t, tokens), eager.logprobs(logits, t, tokens)
        assert torch.allclose(got.sampled, want.sampled, atol=1e-5)
        assert torch.allclose(got.top_values, want.top_values, atol=1e-5)
    # Ties: a flat row's greedy token is its first index, as torch.argmax's; the largest
    # value repeated in the last block and the first gives the first block's index.
    flat = torch.zeros(2, vocab)
    flat[1, [BLOCK + 3, 2 * BLOCK + 5]] = 1.0
    greedy = SamplingTensors.build([SamplingParams(temperature=0.0)] * 2, [0, 0], [0, 0], vocab)
    assert fused(flat, greedy).tolist() == [0, BLOCK + 3] == eager(flat, greedy).tolist()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "fused"])
def test_sample_gives_the_tokens_and_logprobs_of_the_separate_calls(compile):
    if compile:
        pytest.importorskip("triton")
        from tests.triton_target import require_triton

        require_triton()
    sampler = Sampler(compile=compile)
    t = build(PARAMS, prompts=PROMPTS, outputs=OUTPUTS)
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(10)) * 3
    out = torch.full((len(PARAMS),), -1, dtype=torch.int64)
    tokens, lp = sampler.sample(logits, t, out, with_logprobs=True)
    assert tokens is out and torch.equal(out, sampler(logits, t))
    separate = sampler.logprobs(logits, t, out)
    for name in ("sampled", "top_values", "top_ids"):
        assert torch.equal(getattr(lp, name), getattr(separate, name)), name
    assert sampler.sample(logits, t)[1] is None


def test_cache_builds_greedy_rows_once_per_row_count_and_others_every_time():
    """`SamplingTensorCache`: rows that read no per-row value (greedy, no penalties) share
    one set per row count; a sampled row or a penalty makes every call build its own, and a
    greedy set sampled from gives the argmax as a freshly built one does."""
    from hybridd.engine.sampler import SamplingTensorCache

    cache, built = SamplingTensorCache("cpu"), []

    def counted(params):
        def make():
            built.append(len(params))
            return build(params)
        return make

    greedy = [SamplingParams(temperature=0.0)] * 3
    first = cache.get(greedy, 3, counted(greedy))
    assert cache.get(greedy, 3, counted(greedy)) is first and built == [3]
    assert cache.get(greedy, 5, counted(greedy)) is not first and built == [3, 3]  # a verify step's rows
    for params in ([SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 3,
                   [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]):
        a, b = cache.get(params, len(params), counted(params)), cache.get(params, len(params), counted(params))
        assert a is not b
    assert built == [3, 3, 3, 3, 2, 2]
    logits = torch.randn(3, V)
    assert torch.equal(Sampler(compile=False)(logits, first), logits.argmax(-1))
