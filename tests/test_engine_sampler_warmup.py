"""Sampler warm-up: every path runs before serving, and a path whose compilation fails
falls back to its eager version instead of keeping the daemon from starting."""

from __future__ import annotations

import torch

from hybridd.engine import sampler as sampler_module
from hybridd.engine.sampler import Sampler, SamplingTensors
from hybridd.protocol.messages import SamplingParams


def test_failed_path_falls_back_to_eager_and_still_samples():
    sampler = Sampler(compile=False)

    def broken_compiled_path(*args):
        raise RuntimeError("inductor exploded")

    sampler._random = broken_compiled_path  # stands for a compiled path that fails
    calls = []
    failed = sampler.warm_up(64, "cpu", on_progress=lambda done, total: calls.append((done, total)))
    assert set(failed) == {"_random"} and "inductor exploded" in failed["_random"]
    assert calls == [(i, len(calls)) for i in range(1, len(calls) + 1)] and len(calls) >= 3
    assert sampler._random is sampler_module._sample_random
    params = [SamplingParams(temperature=0.8, seed=3)] * 2
    tokens = sampler(torch.randn(2, 64), SamplingTensors.build(params, [3, 3], [0, 0], 64))
    assert tokens.shape == (2,) and int(tokens.max()) < 64


def test_all_paths_warm_without_failures():
    assert Sampler(compile=False).warm_up(64, "cpu") == {}


def test_warm_up_takes_a_subset_and_names_an_unknown_variant():
    calls = []
    assert Sampler(compile=False).warm_up(64, "cpu", lambda done, total: calls.append((done, total)),
                                          variants=["_greedy", "_logprobs_sorted"]) == {}
    assert calls == [(1, 2), (2, 2)]
    try:
        Sampler(compile=False).warm_up(64, "cpu", variants=["_greedy", "_beam"])
    except ValueError as error:
        assert "unknown sampler warm-up variants ['_beam']" in str(error) and "_greedy" in str(error)
    else:
        raise AssertionError("an unknown variant was accepted")
