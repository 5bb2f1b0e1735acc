"""The sampler's fused Triton kernels on CUDA: every variant compiles at warm-up (no eager
fallback), nothing compiles while serving, and they draw the eager functions' tokens
(GPU machine only)."""

from __future__ import annotations

import pytest
import torch

from hybridd.engine.sampler import Sampler, SamplingTensors
from hybridd.protocol.messages import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
VOCAB = 32000


@pytest.mark.parametrize("vocab", [VOCAB, 128256], ids=["llama2-vocab", "llama3-vocab"])
def test_every_path_compiles_and_matches_eager(vocab):
    compiled = Sampler(compile=True)
    assert compiled.warm_up(vocab, "cuda") == {}
    eager = Sampler(compile=False)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=0.9, top_k=50, seed=4),
        SamplingParams(temperature=1.1, top_p=0.8, seed=5),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=6),
    ]
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = mismatched = 0
    for rows in (params[:1], params[1:2], params[3:4], params, params * 4):
        for step in range(4):
            logits = torch.randn(len(rows), vocab, device="cuda", generator=generator) * 3
            tensors = SamplingTensors.build(rows, [p.seed or 0 for p in rows], [step] * len(rows), vocab, "cuda")
            total += len(rows)
            mismatched += int((compiled(logits, tensors) != eager(logits, tensors)).sum())
    # Fused kernels may round a softmax/cumsum differently and move a top-p cut by one
    # token at a near-tie; anything beyond a rare row is a miscompile.
    assert mismatched <= 2, f"{mismatched} of {total} rows differ"


def test_compiled_sampler_is_total_on_cuda():
    """The parameters that once killed the engine, at and beyond float32's edges, and
    logits with -inf entries, -inf rows and extreme finite values: every row gets a
    token in range, never a -inf one while the row has a finite logit."""
    from tests.test_engine_sampler_totality import TINY, HUGE, assert_total

    sampler = Sampler(compile=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    extreme = torch.finfo(torch.float32).max
    for value in TINY + HUGE:
        rows = [
            SamplingParams(top_p=min(value, 1.0), seed=1),
            SamplingParams(temperature=value, top_p=0.9, seed=2),
            SamplingParams(repetition_penalty=value, top_p=0.9, seed=3),
            SamplingParams(temperature=value, repetition_penalty=value, top_k=5, seed=4),
            SamplingParams(temperature=0.0, repetition_penalty=value),
        ]
        logits = torch.randn(len(rows), VOCAB, device="cuda", generator=generator) * 4
        logits[0, :100] = float("-inf")
        logits[1] = float("-inf")
        logits[2, ::2] = extreme
        logits[3, 1::2] = -extreme
        tensors = SamplingTensors.build(rows, [p.seed or 0 for p in rows], [0] * len(rows), VOCAB, "cuda",
                                        [[0, 1, 2]] * len(rows), [[2, 3, 100]] * len(rows))
        assert_total(logits.cpu(), sampler(logits, tensors).cpu())


def test_compiled_logprobs_match_eager_on_cuda():
    compiled, eager = Sampler(compile=True), Sampler(compile=False)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20),
        SamplingParams(temperature=0.7, seed=3, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=4, logprobs=True),
    ]
    generator = torch.Generator(device="cuda").manual_seed(1)
    for rows in (params[:1], params, params * 3):
        logits = torch.randn(len(rows), VOCAB, device="cuda", generator=generator) * 3
        tensors = SamplingTensors.build(rows, [p.seed or 0 for p in rows], [0] * len(rows), VOCAB, "cuda")
        tokens = eager(logits, tensors)
        got, want = compiled.logprobs(logits, tensors, tokens), eager.logprobs(logits, tensors, tokens)
        assert torch.allclose(got.sampled, want.sampled, atol=1e-4)
        finite = torch.isfinite(want.top_values)
        assert torch.equal(finite, torch.isfinite(got.top_values))
        assert torch.allclose(got.top_values[finite], want.top_values[finite], atol=1e-4)
        assert bool((got.sampled <= 0).all()) and got.top_ids.shape == (len(rows), 20)


def _compiled_kernels() -> int:
    from triton.runtime.jit import JITFunction

    from hybridd.engine import sampling_kernels

    kernels = [k for k in vars(sampling_kernels).values() if isinstance(k, JITFunction)]
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


def test_nothing_compiles_while_serving():
    """After warm-up, no batch a client can ask for (any mix of greedy, sampled, top-k/top-p
    and penalised rows, with or without logprobs, 1 to 64 rows) compiles a kernel: a
    compilation would stall every stream on the serving loop."""
    sampler = Sampler(compile=True)
    assert sampler.warm_up(VOCAB, "cuda") == {}
    warmed = _compiled_kernels()
    assert warmed > 0
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=0.7, top_k=20, seed=2),
        SamplingParams(temperature=1.0, top_p=0.5, seed=3),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.9, repetition_penalty=1.2, top_p=0.9, seed=4),
        SamplingParams(temperature=0.9, frequency_penalty=0.5, seed=5),
    ]
    # An odd ring width and logits one element into their buffer: pointers of any
    # alignment, as the step pipeline's ring and the shared arena might hand over.
    ring = torch.zeros(3, 65, dtype=torch.int64, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(2)
    for n in (1, 2, 7, 32, 64):
        for first in range(len(kinds)):
            rows = [kinds[(first + i) % len(kinds)] for i in range(n)] if first else [kinds[0]] * n
            flat = torch.randn(n * VOCAB + 1, device="cuda", generator=generator)
            logits = flat[first % 2:][: n * VOCAB].view(n, VOCAB)
            tensors = SamplingTensors.build(rows, [7] * n, [3] * n, VOCAB, "cuda", [[1, 2]] * n, [[3]] * n)
            out = ring[first % 3, :n]
            sampler.logprobs(logits, tensors, sampler(logits, tensors, out=out))
    torch.cuda.synchronize()
    assert _compiled_kernels() == warmed
