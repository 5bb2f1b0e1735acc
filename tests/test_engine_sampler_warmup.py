"""Sampler warm-up: every kernel combination runs before serving, and a failing kernel
compilation falls back to the eager sampler instead of keeping the daemon from starting."""

from __future__ import annotations

import sys

import pytest
import torch

from hybridd.engine.sampler import WARM_UP_VARIANTS, Sampler, SamplingTensors
from hybridd.protocol.messages import SamplingParams


class BrokenKernels:
    """Stands for fused kernels whose compilation fails."""

    def __init__(self, logits, tensors):
        raise RuntimeError("ptxas exploded")


def test_failed_compilation_falls_back_to_eager_and_still_samples():
    sampler = Sampler(compile=False)
    sampler._fused = BrokenKernels
    calls = []
    failed = sampler.warm_up(64, "cpu", on_progress=lambda done, total: calls.append((done, total)))
    first = next(iter(WARM_UP_VARIANTS))
    assert set(failed) == {first} and "ptxas exploded" in failed[first]
    assert calls == [(i, len(WARM_UP_VARIANTS)) for i in range(1, len(WARM_UP_VARIANTS) + 1)]
    assert sampler._fused is None
    params = [SamplingParams(temperature=0.8, seed=3)] * 2
    tokens = sampler(torch.randn(2, 64), SamplingTensors.build(params, [3, 3], [0, 0], 64))
    assert tokens.shape == (2,) and int(tokens.max()) < 64


def test_every_variant_warms_without_failures():
    assert Sampler(compile=False).warm_up(64, "cpu") == {}


def test_warm_up_covers_every_kernel_switch():
    """Penalties and the top-k/top-p cut are compile-time switches of the kernels: each
    combination is a variant, so no request compiles one while serving."""
    combos = {(p.has_penalties, p.top_k > 0 or p.top_p < 1.0, p.greedy) for p in WARM_UP_VARIANTS.values()}
    assert {(pen, cut) for pen, cut, _ in combos} == {(False, False), (False, True), (True, False), (True, True)}
    assert {greedy for _, _, greedy in combos} == {True, False}


def test_fused_warm_up_compiles_every_variant():
    pytest.importorskip("triton")
    from tests.triton_target import DEVICE, require_triton

    require_triton()
    assert Sampler(compile=True).warm_up(300, DEVICE) == {}


def test_warm_up_takes_a_subset_and_names_an_unknown_variant():
    calls = []
    assert Sampler(compile=False).warm_up(64, "cpu", lambda done, total: calls.append((done, total)),
                                          variants=["greedy", "penalised_top_k_top_p"]) == {}
    assert calls == [(1, 2), (2, 2)]
    with pytest.raises(ValueError, match=r"unknown sampler warm-up variants \['beam'\]") as error:
        Sampler(compile=False).warm_up(64, "cpu", variants=["greedy", "beam"])
    assert "greedy" in str(error.value)


def test_without_triton_the_sampler_samples_eagerly(monkeypatch):
    monkeypatch.setitem(sys.modules, "hybridd.engine.sampling_kernels", None)  # import fails
    sampler = Sampler(compile=True)
    assert sampler._fused is None
    params = [SamplingParams(temperature=0.8, seed=3)] * 2
    tensors = SamplingTensors.build(params, [3, 3], [0, 0], 64)
    logits = torch.randn(2, 64)
    assert torch.equal(sampler(logits, tensors), Sampler(compile=False)(logits, tensors))
