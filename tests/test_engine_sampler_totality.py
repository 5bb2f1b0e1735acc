"""The sampler is total: any parameters the protocol accepts and any logits whose
entries are finite or -inf give every row a token id in [0, V), never one whose
logit is -inf while the row has a finite one; on the eager and the compiled path.

Property-based (hypothesis) over parameters at and beyond float32's edges
(subnormals, the smallest positive double, values that round to 0 or 1 in
float32, doubles above float32's range) and logits with -inf entries, -inf rows
and extreme finite values."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridd.engine.sampler import MAX_POSITIVE, MIN_POSITIVE, Sampler, SamplingTensors, float32_parameters
from hybridd.protocol.messages import SamplingParams
from hybridd.protocol.limits import MAX_ABS_PENALTY, MAX_SEED, MAX_TOKEN_ID

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
SMALLEST_DOUBLE = 5e-324
NEG_INF = float("-inf")

# Legal values that are degenerate in float32, plus ordinary ones.
TINY = [SMALLEST_DOUBLE, 1e-320, 1e-300, 1e-50, 1e-45, 1e-40, 2.0**-126, 1e-30]
HUGE = [1e30, 1e38, FLOAT32_MAX, 1e39, 1e300, sys.float_info.max]
temperatures = st.one_of(
    st.just(0.0),
    st.sampled_from(TINY + HUGE + [0.7, 1.0, 2.0]),
    st.floats(min_value=0.0, max_value=sys.float_info.max),
)
top_ps = st.one_of(
    st.sampled_from(TINY + [0.3, 0.9, 1 - 2.0**-25, 1 - 1e-9, 1 - 2.0**-53, 1.0]),
    st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
)
top_ks = st.one_of(st.sampled_from([-1, 0, 1, 2, 5, MAX_TOKEN_ID]), st.integers(-1, MAX_TOKEN_ID))
repetition_penalties = st.one_of(
    st.sampled_from(TINY + HUGE + [0.5, 1.0, 1.3]),
    st.floats(min_value=0.0, max_value=sys.float_info.max, exclude_min=True),
)
additive_penalties = st.one_of(
    st.sampled_from([0.0, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, SMALLEST_DOUBLE, -SMALLEST_DOUBLE]),
    st.floats(min_value=-MAX_ABS_PENALTY, max_value=MAX_ABS_PENALTY),
)
params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_k=top_ks,
    top_p=top_ps,
    repetition_penalty=repetition_penalties,
    presence_penalty=additive_penalties,
    frequency_penalty=additive_penalties,
)
logit_values = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from([NEG_INF, -FLOAT32_MAX, FLOAT32_MAX, 0.0, -0.0, 1e-45, -1e-45]),
)


# Appended to every batch of the compiled test: with it each batch takes the sorted
# path with penalties at one shape, so the compiler runs once, not once per variant.
ANCHOR = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.1)


@st.composite
def batches(draw, vocab_sizes=(1, 2, 3, 40, 300), row_counts=(1, 2, 3, 4), anchor=False):
    vocab = draw(st.sampled_from(vocab_sizes))
    rows = draw(st.sampled_from(row_counts))
    row_params = [draw(params) for _ in range(rows - anchor)] + [ANCHOR] * anchor
    logits = []
    for _ in range(rows):
        shape = draw(st.sampled_from(["any", "all -inf", "one finite", "extremes", "ties"]))
        if shape == "any":
            row = draw(st.lists(logit_values, min_size=vocab, max_size=vocab))
        elif shape == "all -inf":
            row = [NEG_INF] * vocab
        elif shape == "one finite":
            row = [NEG_INF] * vocab
            row[draw(st.integers(0, vocab - 1))] = draw(logit_values.filter(lambda x: x != NEG_INF))
        elif shape == "extremes":
            row = draw(st.lists(st.sampled_from([NEG_INF, -FLOAT32_MAX, FLOAT32_MAX]), min_size=vocab, max_size=vocab))
        else:
            row = [draw(st.sampled_from([1.0, 2.0, NEG_INF])) for _ in range(vocab)]
        logits.append(row)
    token_ids = st.lists(st.integers(0, vocab - 1), max_size=6)
    prompts = [draw(token_ids.map(lambda ids: ids or [0])) for _ in range(rows)]
    outputs = [draw(token_ids) for _ in range(rows)]
    seeds = [draw(st.integers(0, MAX_SEED)) for _ in range(rows)]
    positions = [draw(st.integers(0, 2**31)) for _ in range(rows)]
    tensors = SamplingTensors.build(row_params, seeds, positions, vocab, "cpu", prompts, outputs)
    return torch.tensor(logits, dtype=torch.float32), tensors, row_params


def assert_total(logits: torch.Tensor, tokens: torch.Tensor) -> None:
    rows, vocab = logits.shape
    assert tokens.shape == (rows,) and tokens.dtype == torch.int64
    for row, token in enumerate(tokens.tolist()):
        assert 0 <= token < vocab, f"row {row}: token {token} outside [0, {vocab})"
        if bool(torch.isfinite(logits[row]).any()):
            assert logits[row, token] != NEG_INF, f"row {row}: drew token {token} whose logit is -inf"


EAGER = Sampler(compile=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_eager_sampler_is_total(batch):
    logits, tensors, _ = batch
    assert_total(logits, EAGER(logits, tensors))
    processed = Sampler.processed_logits(logits, tensors)
    assert not bool(processed.isnan().any()), "processed logits contain NaN"
    assert not bool((processed == float("inf")).any()), "processed logits contain +inf"


@pytest.fixture(scope="module")
def compiled() -> Sampler:
    return Sampler(compile=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(batches(vocab_sizes=(40,), row_counts=(5,), anchor=True))
def test_compiled_sampler_is_total(compiled, batch):
    logits, tensors, _ = batch
    assert_total(logits, compiled(logits, tensors))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(top_p=1e-300),
        SamplingParams(top_p=SMALLEST_DOUBLE),
        SamplingParams(temperature=1e-40, top_p=0.9),
        SamplingParams(repetition_penalty=SMALLEST_DOUBLE, top_p=0.9),
        SamplingParams(temperature=1e300, top_k=3),
        SamplingParams(repetition_penalty=1e300, top_p=0.5),
    ],
    ids=["top_p=1e-300", "top_p=5e-324", "temperature=1e-40", "repetition_penalty=5e-324", "temperature=1e300",
         "repetition_penalty=1e300"],
)
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_degenerate_parameters_that_killed_the_engine(sampling, compile, request):
    sampler = request.getfixturevalue("compiled") if compile else EAGER
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, 7] = NEG_INF
    rows = [sampling] * 4 + [ANCHOR]  # the compiled test's shape and path: no recompilation
    tensors = SamplingTensors.build(rows, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], 40, "cpu", [[1, 7]] * 5, [[2, 7]] * 5)
    assert_total(logits, sampler(logits, tensors))


def test_float32_parameters_never_degenerate():
    """The SPEC's rule: positive parameters are clamped into [2**-126, 2**126], top_p
    into [2**-126, 1]; a value is neither 0, a subnormal nor above float32's range,
    and neither is its reciprocal."""
    for value in TINY + HUGE + [1.0]:
        f = float32_parameters(SamplingParams(temperature=value, repetition_penalty=value, top_p=min(value, 1.0)))
        for name in ("inverse_temperature", "repetition_penalty", "inverse_repetition_penalty", "top_p"):
            as_f32 = float(torch.tensor(f[name], dtype=torch.float32))
            assert MIN_POSITIVE <= as_f32 <= MAX_POSITIVE, (value, name, as_f32)
    assert float32_parameters(SamplingParams(temperature=0.0))["inverse_temperature"] == 0.0
    assert float32_parameters(SamplingParams(temperature=SMALLEST_DOUBLE))["inverse_temperature"] == MAX_POSITIVE
    assert float32_parameters(SamplingParams(temperature=1e300))["inverse_temperature"] == MIN_POSITIVE
    assert float32_parameters(SamplingParams(top_p=1e-300))["top_p"] == MIN_POSITIVE


def test_smallest_top_p_keeps_only_the_best_token():
    """top_p that rounds to 0 in float32 acts as the smallest positive top_p: only the
    most probable token survives, so every draw is the argmax."""
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(1))
    for top_p in (SMALLEST_DOUBLE, 1e-300, 1e-40):
        tensors = SamplingTensors.build([SamplingParams(top_p=top_p)] * 64, list(range(64)), [0] * 64, 40)
        assert torch.equal(EAGER(logits, tensors), logits.argmax(dim=-1))


def test_tiny_temperature_is_greedy_and_huge_temperature_spreads():
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(2))
    cold = SamplingTensors.build([SamplingParams(temperature=1e-40)] * 64, list(range(64)), [0] * 64, 40)
    assert torch.equal(EAGER(logits, cold), logits.argmax(dim=-1))
    row = logits[:1].expand(2000, 40)
    hot = SamplingTensors.build([SamplingParams(temperature=1e300)] * 2000, [9] * 2000, list(range(2000)), 40)
    drawn = torch.bincount(EAGER(row, hot), minlength=40)
    assert int((drawn > 0).sum()) == 40  # uniform over the vocabulary: every token drawn


def test_top_p_that_rounds_to_one_is_off():
    logits = torch.zeros(4000, 5)
    logits[:, 0] = 5.0  # p(token 0) is about 0.97: a top_p just below 1 still admits the rest
    tensors = SamplingTensors.build([SamplingParams(top_p=1 - 1e-9)] * 4000, [3] * 4000, list(range(4000)), 5)
    assert tensors.top_p[0] == 1.0
    assert int((EAGER(logits, tensors) != 0).sum()) > 0
