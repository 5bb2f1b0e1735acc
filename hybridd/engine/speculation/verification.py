"""Verification: which drafted tokens a verify step keeps, with the target's
distribution exactly (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).

A verify step scores a sequence's last token and its k draft tokens d_1..d_k in k + 1
rows; row j holds the target's distribution p_j of the token at position P + j (P the
position after the sequence's last token) given the sequence and d_1..d_j: the processed
distribution any row of the target is sampled from (`Sampler`: the grammar's mask,
penalties counting d_1..d_j as output, temperature, top-k, top-p). Each row yields one
token y_j, and the sequence keeps y_0 .. y_a, a the first row with y_a != d_{a+1} (or k,
every draft kept, y_k the bonus token): `accepted_tokens`. What y_j is, per draft:

- A draft with a distribution q_j (a draft model's, `Draft.probabilities`), on a sampled
  row: the rejection rule (`rejection_rule`). d_{j+1} is kept with probability
  min(1, p_j(d)/q_j(d)) (a uniform u: kept iff u·q <= p), and otherwise y_j is drawn from
  norm(max(p_j - q_j, 0)), which never holds d_{j+1} (a rejection needs p(d) < q(d)). A
  draft token the grammar refuses is scored by the row before it like any other (p is 0
  there: always rejected, the residual drawn), so where the grammar cuts a draft short
  the rows still follow the rule exactly. The uniform and the residual's (drawn by
  inverting its cumulative sum at a second uniform) are hashes of (the request's seed,
  salted, position), like the sampler's own noise, so
  a seeded request gives the same tokens again wherever it gets the same drafts.
- A draft without a distribution (prompt lookup, an EAGLE-3 head: a point mass on
  d_{j+1}), or a greedy row: y_j is the target's own draw at that position (greedy: its argmax). For a point
  mass this is the rejection rule realised with the target's noise: d_{j+1} is kept with
  probability p_j(d_{j+1}) (the chance the target draws it) and otherwise y_j is the
  target's draw given that it is not d_{j+1}, i.e. from norm(max(p_j - q_j, 0)). Its
  acceptance is the rule's, and every y_j being the token the target alone would have
  drawn, the output is the one without speculation, token for token, greedy or seeded.

Why a draft model is not verified by that coupled draw too (its tokens drawn with the
target's noise, kept iff the target drew them, the output then being the one without
speculation): a coupling that neither side steers keeps a draft token with a probability
as low as (1 - δ)/(1 + δ) (δ the total variation distance between p and q; Daliri et al.
2024), where the rule keeps it with 1 - δ, the most any scheme can; on the embedded model
and its draft the rule keeps more draft tokens (tests/test_speculative_sampling.py
measures both). Its output is then distributed as the target's rather than the target's
own draws: a seeded request repeats where it gets the same drafts (the same k at each
step: `speculative_adaptive` false, or the same load). An EAGLE-3 head's drafts are
verified by the coupled draw (its tokens drawn with the target's noise, `eagle3`): its
output stays the one without speculation, token for token, at the coupling's acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridd.engine.sampler import Logprobs, Sampler, SamplingTensors, gumbel_noise
from hybridd.engine.sequence import Sequence
from hybridd.engine.token_bitmask import apply_token_bitmask

# Key the rule's two uniforms apart from the sampler's Gumbel noise of the same (seed,
# position), and from each other.
_UNIFORM_SALT = 0x5BD1E995
_RESIDUAL_SALT = 0x27D4EB2F


@dataclass(frozen=True)
class DraftDistribution:
    """The draft tokens one sequence's verify rows score by the rejection rule, each with
    the draft distribution it was drawn from ([len(tokens), V], on the host): the verify
    step's draft tokens, and after them, where the grammar refused a draft token, that
    token (scored by the sequence's last row, which rejects it)."""

    tokens: list[int]
    probabilities: torch.Tensor

    def shortened(self, num_tokens: int) -> DraftDistribution:
        """For a draft cut to its first `num_tokens` tokens whatever they are (its rows, its KV)."""
        return DraftDistribution(self.tokens[:num_tokens], self.probabilities[:num_tokens])


def accepted_tokens(draft: list[int], target: list[int]) -> list[int]:
    """The tokens a sequence keeps from a verify step: the rows' tokens `target`
    (k + 1 rows) up to and including the first that differs from the draft."""
    kept = []
    for j, token in enumerate(target):
        kept.append(token)
        if j >= len(draft) or draft[j] != token:
            break
    return kept


def verify_sampling_tensors(
    seqs: list[Sequence], drafts: list[list[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> SamplingTensors:
    """Sampling tensors for a verify step's rows (k_i + 1 per sequence, in order): row j
    of a sequence samples position `num_computed_tokens + j` with d_1..d_j counted as
    its output, as decoding without speculation would once they were accepted."""
    params, seeds, positions, prompts, outputs = [], [], [], [], []
    for seq, draft in zip(seqs, drafts, strict=True):
        first = seq.num_computed_tokens
        for j in range(len(draft) + 1):
            params.append(seq.params)
            seeds.append(seq.seed)
            positions.append(first + j)
            prompts.append(seq.prompt_token_ids)
            outputs.append(seq.output_token_ids + draft[:j])
    return SamplingTensors.build(params, seeds, positions, vocab_size, device, prompts, outputs)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, salt: int = _UNIFORM_SALT) -> torch.Tensor:
    """One uniform in (0, 1) per row, a pure function of (seed, position, salt)."""
    gumbel = gumbel_noise(seeds ^ salt, positions, 1)[:, 0]
    return torch.exp(-torch.exp(-gumbel))  # the inverse of the Gumbel transform


def rejection_rule(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft: torch.Tensor,
                   seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row [R] by the rejection rule: `draft` [R] (drawn from `draft_probs`
    [R, V]) where it is kept, with probability min(1, p/q) for p = `target_probs` [R, V],
    else a draw from norm(max(p - q, 0)); the randomness keyed by (`seeds`, `positions`)."""
    index = draft.view(-1, 1)
    p = target_probs.gather(1, index).squeeze(1)
    q = draft_probs.gather(1, index).squeeze(1)
    kept = uniforms(seeds, positions) * q <= p
    # The residual drawn by inverting its cumulative sum at a uniform of its own: the first
    # token whose cumulative mass passes it, which has mass (one uniform a row, not V noises).
    cumulative = (target_probs - draft_probs).clamp(min=0).cumsum(dim=-1)
    total = cumulative[:, -1:]
    point = torch.minimum(uniforms(seeds, positions, _RESIDUAL_SALT).unsqueeze(1) * total,
                          torch.nextafter(total, torch.zeros_like(total)))
    redrawn = torch.searchsorted(cumulative, point, right=True).squeeze(1)
    # No residual mass: p <= q everywhere, so p == q and a rejection has probability 0.
    kept |= total.squeeze(1) <= 0
    return torch.where(kept, draft, redrawn.clamp(max=target_probs.shape[-1] - 1))


@dataclass
class _RuleRows:
    rows: torch.Tensor  # [n] int64: the verify rows the rule decides
    tokens: torch.Tensor  # [n] int64: the draft token each scores
    probabilities: torch.Tensor  # [n, V] float32: its draft distribution


def _rule_rows(seqs: list[Sequence], drafts: list[list[int]],
               distributions: list[DraftDistribution | None] | None) -> _RuleRows | None:
    """The rows decided by the rejection rule: sampled rows whose draft token has a distribution."""
    if distributions is None:
        return None
    rows, tokens, probabilities = [], [], []
    first = 0
    for seq, draft, dist in zip(seqs, drafts, distributions, strict=True):
        if dist is not None and not seq.params.greedy:
            scored = len(dist.tokens)
            rows.extend(range(first, first + scored))
            tokens.extend(dist.tokens)
            probabilities.append(dist.probabilities[:scored])
        first += len(draft) + 1
    if not rows:
        return None
    return _RuleRows(torch.tensor(rows, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64),
                     torch.cat(probabilities).to(torch.float32))


def sample_verify_rows(
    sampler: Sampler, logits: torch.Tensor, tensors: SamplingTensors, seqs: list[Sequence], drafts: list[list[int]],
    distributions: list[DraftDistribution | None] | None, out: torch.Tensor | None = None,
    with_logprobs: bool = False, allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Logprobs | None]:
    """Each verify row's token y_j (see the module docstring), int64 [R] on the logits'
    device (written into `out` as well when given), and their logprobs when asked (from
    the rows' processed distributions, as any row's). `tensors` are the rows'
    (`verify_sampling_tensors`), `allowed` their grammar's masks (`TokenMasks.fill_verify`)."""
    rule = _rule_rows(seqs, drafts, distributions)
    if rule is None:
        return sampler.sample(logits, tensors, out, with_logprobs=with_logprobs, allowed=allowed)
    if allowed is not None:
        logits = apply_token_bitmask(logits, allowed)
    tokens, _ = sampler.sample(logits, tensors, out)
    device = logits.device
    rows = rule.rows.to(device)
    processed = sampler.processed(logits, tensors)
    target = torch.softmax(processed.index_select(0, rows), dim=-1)
    decided = rejection_rule(target, rule.probabilities.to(device), rule.tokens.to(device),
                             tensors.seeds.index_select(0, rows), tensors.positions.index_select(0, rows))
    tokens.index_copy_(0, rows, decided)
    if out is not None and out.data_ptr() != tokens.data_ptr():
        out.copy_(tokens)
    logprobs = Sampler.logprobs_of(processed, tokens) if with_logprobs else None
    return tokens, logprobs
