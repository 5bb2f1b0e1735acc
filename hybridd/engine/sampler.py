"""Batched next-token sampling on the logits' device, without host synchronisation.

Per-row parameters travel as tensors (`SamplingTensors`), so one set of kernels
serves any mix of greedy and sampled rows and the host never waits for the device:
sampling can be enqueued one step ahead, its tokens written straight into the next
step's input buffer.

Pipeline per row: repetition penalty (HF) over prompt + output tokens, then
frequency / presence penalties (OpenAI) over output tokens; greedy rows take the
argmax. Sampled rows: temperature, top-k and top-p (one sort, cut at a per-row
threshold; at least one token always survives), then the Gumbel-max trick,
`argmax(logits + g)`. The noise g
is a pure function of (seed, position, vocab index) computed by a counter-based
integer hash, so a seeded request draws the same tokens in any batch and any row.

The sampler is total: for logits whose entries are finite or -inf (NaN counts as
-inf, +inf as the largest float32) and any parameters the protocol accepts, every
row yields a token id in [0, V), and never one whose logit is -inf while the row
has a finite logit.
Parameters are brought into float32 on the host (`float32_parameters`) so that
no value degenerates on the device: positive parameters are clamped into
[2**-126, 2**126] (never 0, never a subnormal, their reciprocal a normal float
too) and applied by multiplication with host-computed reciprocals, never by device
division (approximate on the GPU); logits are shifted by their row maximum before
scaling, so a tiny temperature saturates to -inf instead of overflowing to +inf.

A row may be constrained by an allowed-token bitmask (structured output): the tokens it
does not allow are -inf before the pipeline starts, so every step below sees only the
allowed ones.

Logprobs, for the batches that ask for them, come from that same distribution: the
log-softmax of the processed logits (penalised; sampled rows also scaled by their
temperature and cut by top-k/top-p, greedy rows unscaled), as OpenAI defines them.
They are computed on the device, right after the tokens: the sampled token's logprob
and the MAX_TOP_LOGPROBS most likely tokens, which the host trims per row.

The functions here are the sampler's specification and its CPU path; on the GPU the
same pipeline runs as fused Triton kernels (`sampling_kernels`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence as Seq
import dataclasses
from dataclasses import dataclass

import torch

from hybridd import environment
from hybridd.protocol.messages import SamplingParams
from hybridd.engine.device_copy import to_device
from hybridd.engine.sequence import Sequence
from hybridd.engine.token_bitmask import apply_token_bitmask
from hybridd.log import get_logger
from hybridd.protocol.limits import MAX_TOP_LOGPROBS

_MASK32 = 0xFFFFFFFF
# Uniforms carry 23 bits so that u < 1 stays exact in float32 and -log(u) > 0.
_UNIFORM_BITS = 23
_SCAN_CHUNK = 256
# Bounds of positive float parameters on the device: the smallest normal float32 and
# its reciprocal, so that a parameter and its reciprocal are both normal floats.
MIN_POSITIVE = 2.0**-126
MAX_POSITIVE = 2.0**126
_FLOAT32_MAX = torch.finfo(torch.float32).max


log = get_logger("sampler")


@dataclass
class Logprobs:
    """Per-row logprobs of one step, on the device until copied: the sampled token's [R],
    and the k most likely tokens' values and ids [R, k], most likely first."""

    sampled: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to(self, out: Logprobs) -> Logprobs:
        """Copy into `out` (e.g. pinned host buffers), non-blocking; returns `out`."""
        for name in ("sampled", "top_values", "top_ids"):
            getattr(out, name).copy_(getattr(self, name), non_blocking=True)
        return out

    @classmethod
    def empty_like(cls, other: Logprobs, pin_memory: bool) -> Logprobs:
        return cls(*(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin_memory)
                     for t in (other.sampled, other.top_values, other.top_ids)))


@dataclass
class SamplingTensors:
    inverse_temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, vocab size when off
    top_p: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32
    inverse_repetition_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, position of the token being sampled
    output_counts: torch.Tensor | None  # [B, V] int32, None when no row has penalties
    prompt_mask: torch.Tensor | None  # [B, V] bool, None when no row has penalties
    all_greedy: bool = False
    do_sort: bool = False  # some row uses top-k or top-p
    vocab_size: int = 0

    @classmethod
    def build(
        cls,
        params: Seq[SamplingParams],
        seeds: Seq[int],
        positions: Seq[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        prompt_token_ids: Seq[Seq[int]] | None = None,
        output_token_ids: Seq[Seq[int]] | None = None,
    ) -> SamplingTensors:
        """Tensors for one batch; token ids are needed only when a row has penalties."""
        n = len(params)
        do_penalties = any(p.has_penalties for p in params)
        output_counts = prompt_mask = None
        if do_penalties:
            if prompt_token_ids is None or output_token_ids is None:
                raise ValueError("penalties need prompt_token_ids and output_token_ids")
            output_counts = torch.zeros(n, vocab_size, dtype=torch.int32)
            prompt_mask = torch.zeros(n, vocab_size, dtype=torch.bool)
            for row, (prompt, output) in enumerate(zip(prompt_token_ids, output_token_ids, strict=True)):
                if output:
                    ids = torch.tensor(output, dtype=torch.int64)
                    output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
                prompt_mask[row, torch.tensor(prompt, dtype=torch.int64)] = True
            output_counts = output_counts.to(device)
            prompt_mask = prompt_mask.to(device)

        rows = [float32_parameters(p) for p in params]

        def f32(name: str) -> torch.Tensor:
            return torch.tensor([row[name] for row in rows], dtype=torch.float32, device=device)

        return cls(
            inverse_temperature=f32("inverse_temperature"),
            top_k=torch.tensor(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                dtype=torch.int64,
                device=device,
            ),
            top_p=f32("top_p"),
            repetition_penalty=f32("repetition_penalty"),
            inverse_repetition_penalty=f32("inverse_repetition_penalty"),
            presence_penalty=f32("presence_penalty"),
            frequency_penalty=f32("frequency_penalty"),
            seeds=torch.tensor(list(seeds), dtype=torch.int64, device=device),
            positions=torch.tensor(list(positions), dtype=torch.int64, device=device),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            all_greedy=all(p.greedy for p in params),
            do_sort=any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in params),
            vocab_size=vocab_size,
        )

    def moved(self, device: torch.device | str) -> SamplingTensors:
        """These tensors (built on the host) on `device`, without a host wait (`device_copy`)."""
        if torch.device(device).type != "cuda":
            return self
        return dataclasses.replace(self, **{
            f.name: to_device(value, device)
            for f in dataclasses.fields(self) if isinstance(value := getattr(self, f.name), torch.Tensor)})

    @classmethod
    def from_sequences(
        cls, seqs: Seq[Sequence], vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        """Tensors for a just-scheduled batch: each row samples the token at position
        `num_computed_tokens`, which is the same whether or not the sequence was
        preempted and recomputed, so seeded output survives preemption."""
        return cls.build(
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [s.num_computed_tokens for s in seqs],
            vocab_size,
            device,
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
        )

    def record(self, tokens: torch.Tensor, in_flight: torch.Tensor | None = None) -> None:
        """Count `tokens` [B] (on the device) as output of their rows (only those where
        `in_flight` [B] is true, when given): the tokens a step ahead of the host, which
        sampled them but has not seen them yet. Penalties then see every output token
        without a host wait, so penalty batches pipeline like any other."""
        if self.output_counts is None:
            return
        index = tokens.to(torch.int64).view(-1, 1)
        ones = torch.ones_like(index, dtype=torch.int32) if in_flight is None else in_flight.to(torch.int32).view(-1, 1)
        self.output_counts.scatter_add_(1, index, ones)


class SamplingTensorCache:
    """The sampling tensors of rows that read none of their per-row values (greedy, no
    penalties): one set per row count, built once and kept on `device`, so that a step or
    a draft step of such rows copies nothing to the device; other rows' tensors are built
    and moved each time."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self._sets: dict[int, SamplingTensors] = {}

    def get(self, params: Seq[SamplingParams], rows: int, build: Callable[[], SamplingTensors]) -> SamplingTensors:
        """The tensors of `rows` rows sampled with `params` (one per sequence; a verify step
        has more rows than sequences), `build()` where they are not cached."""
        if not all(p.greedy and not p.has_penalties for p in params):
            return build().moved(self.device)
        if rows not in self._sets:
            self._sets[rows] = build().moved(self.device)
        return self._sets[rows]


def float32_parameters(params: SamplingParams) -> dict[str, float]:
    """The values the device computes with, for parameters the protocol accepts:
    positive values clamped into [MIN_POSITIVE, MAX_POSITIVE] (top_p into
    [MIN_POSITIVE, 1]), reciprocals taken here in float64. A top_p that rounds to 1
    in float32 is off; penalties that round to 0 have no effect."""

    def positive(value: float) -> float:
        return min(max(float(value), MIN_POSITIVE), MAX_POSITIVE)

    temperature = 0.0 if params.greedy else positive(params.temperature)
    repetition = positive(params.repetition_penalty)
    return {
        "inverse_temperature": 0.0 if temperature == 0.0 else 1.0 / temperature,
        "top_p": min(max(float(params.top_p), MIN_POSITIVE), 1.0),
        "repetition_penalty": repetition,
        "inverse_repetition_penalty": 1.0 / repetition,
        "presence_penalty": float(params.presence_penalty),
        "frequency_penalty": float(params.frequency_penalty),
    }


class Sampler:
    """Draws each row's next token (and, when asked, its logprobs).

    compile: draw through the fused Triton kernels of `sampling_kernels`, JIT-compiled
    at warm-up (the GPU path); otherwise through the eager torch functions below,
    which are also their specification (the CPU path)."""

    def __init__(self, compile: bool = True) -> None:
        self.compiled = compile
        self._fused = None
        self._interpreted = environment.flag("TRITON_INTERPRET")
        if compile:
            try:
                from hybridd.engine.sampling_kernels import FusedSampling
            except ImportError as exc:  # no Triton: the eager sampler still serves
                log.warning("sampler_kernels_unavailable", error=str(exc), consequence="sampling eagerly")
            else:
                self._fused = FusedSampling

    def warm_up(
        self, vocab_size: int, device: torch.device | str, on_progress=None, variants: Iterable[str] | None = None,
    ) -> dict[str, str]:
        """Run every sampling path once (compiling its kernels) before serving starts, so
        that no request compiles on the serving loop; `variants` (names from
        `WARM_UP_VARIANTS`) limits it to some. If a kernel fails to compile, the sampler
        falls back to the eager functions, so the process still serves; returns
        {variant: error} for the variant that failed."""
        names = list(WARM_UP_VARIANTS) if variants is None else list(variants)
        unknown = sorted(set(names) - set(WARM_UP_VARIANTS))
        if unknown:
            raise ValueError(f"unknown sampler warm-up variants {unknown}; known: {list(WARM_UP_VARIANTS)}")
        failed: dict[str, str] = {}
        for i, name in enumerate(names, 1):
            params = WARM_UP_VARIANTS[name]
            if on_progress is not None:
                on_progress(i, len(names))
            try:
                for rows in (1, 3):
                    logits = torch.randn(rows, vocab_size, device=device)
                    history = [[0, 1]] * rows
                    tensors = SamplingTensors.build([params] * rows, [0] * rows, [0] * rows, vocab_size, device,
                                                    history, history)
                    self.sample(logits, tensors, with_logprobs=True)
            except Exception as exc:  # a compiler failure must not keep the daemon from serving
                failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log.warning("sampler_compile_failed", variant=name, error=failed[name])
                self._fused = None
        return failed

    def sample(
        self, logits: torch.Tensor, t: SamplingTensors, out: torch.Tensor | None = None, with_logprobs: bool = False,
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Logprobs | None]:
        """Next token per row, int64 [B] (written into `out` as well when given), and, when
        asked, their logprobs (see `logprobs`); on the fused path both come from the same
        row maxima and top-k/top-p cut. `allowed`: an allowed-token bitmask [B, words] on
        the logits' device (`token_bitmask`), applied before anything else."""
        if allowed is not None:
            logits = apply_token_bitmask(logits, allowed)
        if self._runs_fused(logits):
            fused = self._fused(logits, t)
            tokens, processed = fused.tokens(out), fused.processed
        else:
            tokens, processed = _eager_tokens(logits, t, out), lambda: self.processed_logits(logits, t)
        return tokens, Logprobs(*_logprobs(processed(), tokens)) if with_logprobs else None

    def __call__(
        self, logits: torch.Tensor, t: SamplingTensors, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next token per row, int64 [B]; written into `out` as well when given."""
        return self.sample(logits, t, out)[0]

    def logprobs(self, logits: torch.Tensor, t: SamplingTensors, tokens: torch.Tensor) -> Logprobs:
        """Logprobs of the sampled `tokens` and of each row's most likely tokens, from the
        distribution they were sampled from (see the module docstring)."""
        return self.logprobs_of(self.processed(logits, t), tokens)

    @staticmethod
    def logprobs_of(processed: torch.Tensor, tokens: torch.Tensor) -> Logprobs:
        """Logprobs of `tokens` and of each row's most likely tokens under `processed` logits."""
        return Logprobs(*_logprobs(processed, tokens))

    def processed(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """The logits each row draws from (`processed_logits`), by the fused kernels where they run."""
        if self._runs_fused(logits):
            return self._fused(logits, t).processed()
        return self.processed_logits(logits, t)

    def _runs_fused(self, logits: torch.Tensor) -> bool:
        # Triton runs CUDA tensors, and CPU ones only in its interpreter (the tests' CPU path).
        return self._fused is not None and (logits.is_cuda or self._interpreted)

    @staticmethod
    def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """The logits each row draws from, as the logprobs see them (eager)."""
        return _processed(logits, t.inverse_temperature, t.top_k, t.top_p, *_penalty_tensors(t), t.do_sort)


def _eager_tokens(logits: torch.Tensor, t: SamplingTensors, out: torch.Tensor | None) -> torch.Tensor:
    penalties = _penalty_tensors(t)
    if t.all_greedy:
        tokens = _sample_greedy(logits, *penalties)
    else:
        fn = _sample_sorted if t.do_sort else _sample_random
        tokens = fn(logits, t.inverse_temperature, t.top_k, t.top_p, *penalties, t.seeds, t.positions)
    if out is None:
        return tokens
    out.copy_(tokens)
    return out


def _penalty_tensors(t: SamplingTensors) -> tuple:
    return (
        t.repetition_penalty,
        t.inverse_repetition_penalty,
        t.presence_penalty,
        t.frequency_penalty,
        t.output_counts,
        t.prompt_mask,
    )


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V], a pure function of (seed, position, vocab index)."""
    row = _mix32((positions & _MASK32) ^ 0x9E3779B9)
    row = _mix32(row ^ ((seeds >> 32) & _MASK32))
    row = _mix32(row ^ (seeds & _MASK32))
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(row.unsqueeze(1) ^ vocab.unsqueeze(0)) ^ 0x85EBCA6B)
    u = ((bits >> (32 - _UNIFORM_BITS)).to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)
    return -torch.log(-torch.log(u))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for 0 <= x < 2**32 in int64 without signed overflow: split c
    # into 16-bit halves so that no partial product reaches 2**63.
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # "triple32" integer hash (C. Wellons), a bijection on 32-bit values with full avalanche.
    x = x ^ (x >> 17)
    x = _mul32(x, 0xED5AD4BB)
    x = x ^ (x >> 11)
    x = _mul32(x, 0xAC4C1B51)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x31848BAB)
    return x ^ (x >> 14)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with no NaN and no +inf: NaN is -inf (never drawn while a row
    has a finite entry), +inf the largest finite float32."""
    return torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=_FLOAT32_MAX, neginf=float("-inf"))


def _penalize(
    logits: torch.Tensor,
    repetition: torch.Tensor,
    inverse_repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
) -> torch.Tensor:
    if counts is None or prompt_mask is None:
        return logits
    in_output = counts > 0
    repeated = torch.where(logits > 0, logits * inverse_repetition.unsqueeze(1), logits * repetition.unsqueeze(1))
    penalized = torch.where(in_output | prompt_mask, repeated, logits)
    penalized = penalized - frequency.unsqueeze(1) * counts.to(logits.dtype)
    penalized = penalized - presence.unsqueeze(1) * in_output.to(logits.dtype)
    # A penalty can push a logit past float32; it stays finite (the largest or the
    # smallest float32), so only a logit that came in as -inf is never drawn.
    return torch.where(logits == float("-inf"), logits, penalized.clamp(-_FLOAT32_MAX, _FLOAT32_MAX))


def _scale(logits: torch.Tensor, inverse_temperature: torch.Tensor) -> torch.Tensor:
    """(logits - row max) / temperature: the row's best token scales to 0 and the rest
    to <= 0 (-inf at worst), so no temperature makes an entry +inf or NaN."""
    top = logits.amax(dim=-1, keepdim=True)
    shifted = logits - torch.where(torch.isfinite(top), top, 0.0)
    return shifted * torch.where(inverse_temperature > 0, inverse_temperature, 1.0).unsqueeze(1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits = logits.sort(dim=-1, descending=True).values
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    in_top_k = ranks < top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    mass_before = _cumsum_rows(probs) - probs
    # A token stays while the mass ranked above it is below top_p, so the first one
    # always stays; rows with top_p == 1 skip the test, as a float cumsum can reach 1 early.
    in_top_p = (mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    # Both conditions keep a prefix of the ranking, so it is cut at one threshold
    # value per row (tokens tied with the last kept one stay too). Thresholding
    # avoids scattering the sorted row back, which torch 2.13's CPU inductor miscompiles.
    # At least one: a row of -inf logits has NaN probabilities and so no survivor.
    num_kept = (in_top_k & in_top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = sorted_logits.gather(-1, num_kept - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum along the last dimension of [B, V], in two levels
    (within chunks of _SCAN_CHUNK, then over the chunks' totals). A single scan over a
    long row with few rows makes inductor emit a split scan, whose CUDA code generation
    fails with dynamic shapes (torch 2.11); short scans over many rows do not."""
    rows, width = x.shape
    chunks = (width + _SCAN_CHUNK - 1) // _SCAN_CHUNK
    padded = torch.nn.functional.pad(x, (0, chunks * _SCAN_CHUNK - width)).view(rows, chunks, _SCAN_CHUNK)
    within = padded.cumsum(dim=-1)
    totals = within[..., -1]
    before = totals.cumsum(dim=-1) - totals
    return (within + before.unsqueeze(-1)).view(rows, chunks * _SCAN_CHUNK)[:, :width]


def _sample_greedy(logits, repetition, inverse_repetition, presence, frequency, counts, prompt_mask):
    penalties = (repetition, inverse_repetition, presence, frequency, counts, prompt_mask)
    return _penalize(_finite(logits), *penalties).argmax(dim=-1)


def _sample_random(
    logits, inverse_temperature, top_k, top_p, repetition, inverse_repetition, presence, frequency, counts,
    prompt_mask, seeds, positions,
):
    logits = _penalize(_finite(logits), repetition, inverse_repetition, presence, frequency, counts, prompt_mask)
    perturbed = _scale(logits, inverse_temperature) + gumbel_noise(seeds, positions, logits.shape[-1])
    return _pick(logits, perturbed, inverse_temperature)


def _sample_sorted(
    logits, inverse_temperature, top_k, top_p, repetition, inverse_repetition, presence, frequency, counts,
    prompt_mask, seeds, positions,
):
    logits = _penalize(_finite(logits), repetition, inverse_repetition, presence, frequency, counts, prompt_mask)
    filtered = _top_k_top_p(_scale(logits, inverse_temperature), top_k, top_p)
    perturbed = filtered + gumbel_noise(seeds, positions, logits.shape[-1])
    return _pick(logits, perturbed, inverse_temperature)


def _processed(
    logits, inverse_temperature, top_k, top_p, repetition, inverse_repetition, presence, frequency,
    counts, prompt_mask, do_sort: bool,
):
    """The logits sampled rows draw from (penalised, scaled, filtered with -inf); greedy
    rows get their penalised logits."""
    logits = _penalize(_finite(logits), repetition, inverse_repetition, presence, frequency, counts, prompt_mask)
    scaled = _scale(logits, inverse_temperature)
    if do_sort:
        scaled = _top_k_top_p(scaled, top_k, top_p)
    return torch.where((inverse_temperature > 0).unsqueeze(1), scaled, logits)


def _logprobs(processed: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = processed.log_softmax(dim=-1)
    sampled = logprobs.gather(1, tokens.view(-1, 1).to(torch.int64)).squeeze(1)
    top = logprobs.topk(min(MAX_TOP_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return sampled, top.values, top.indices


def _pick(logits: torch.Tensor, perturbed: torch.Tensor, inverse_temperature: torch.Tensor) -> torch.Tensor:
    return torch.where((inverse_temperature > 0).unsqueeze(1), perturbed, logits).argmax(dim=-1)


# The batches `Sampler.warm_up` draws from (with logprobs), one per combination of the
# kernels' compile-time switches: penalties, and the top-k/top-p cut.
WARM_UP_VARIANTS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "random": SamplingParams(temperature=0.8),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
    "penalised_greedy": SamplingParams(temperature=0.0, repetition_penalty=1.1),
    "penalised_random": SamplingParams(temperature=0.8, presence_penalty=0.5),
    "penalised_top_k_top_p": SamplingParams(temperature=0.8, top_p=0.9, frequency_penalty=0.5),
}
