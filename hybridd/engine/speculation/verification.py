"""Verification: which drafted tokens a verify step keeps, with the target's
distribution exactly (Leviathan et al. 2023, Chen et al. 2023).

A verify step scores a sequence's last token and its k draft tokens d_1..d_k in k + 1
rows; row j holds the target's distribution p_j of the token at position p + 1 + j
given the sequence and d_1..d_j. Every row is sampled like any other row of the
target (`Sampler`: penalties counting d_1..d_j as output, temperature, top-k, top-p;
Gumbel noise keyed by the request's seed and the token's position), giving y_j.

Draft without a distribution (a point mass: prompt lookup). Rejection sampling then
accepts d_{j+1} with probability p_j(d_{j+1}) and otherwise draws from p_j without
d_{j+1}; the coupled draw y_j realises exactly that: accept d_{j+1} iff y_j = d_{j+1},
and on the first mismatch y_j is the target's token. The output is y_0 .. y_a, a the
first mismatch (or k, all accepted, y_k the bonus token). Each y_j is the token the
target alone would have drawn at that position, so the output is the one of decoding
without speculation, token for token, greedy or seeded.

Draft with a distribution q (a draft model): `rejection_sample` is the general rule,
accept with probability min(1, p/q), else draw from norm(max(p - q, 0)).
"""

from __future__ import annotations

import torch

from hybridd.engine.sampler import SamplingTensors, gumbel_noise
from hybridd.engine.sequence import Sequence

# Keys the accept/reject uniforms apart from the Gumbel noise of the same (seed, position).
_UNIFORM_SALT = 0x5BD1E995


def accepted_tokens(draft: list[int], target: list[int]) -> list[int]:
    """The tokens a sequence keeps from a verify step: the target's draws `target`
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


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, a pure function of (seed, position)."""
    gumbel = gumbel_noise(seeds ^ _UNIFORM_SALT, positions, 1)[:, 0]
    return torch.exp(-torch.exp(-gumbel))  # the inverse of the Gumbel transform


def rejection_sample(
    target_probs: torch.Tensor, draft: torch.Tensor, draft_probs: torch.Tensor, seed: int, first_position: int
) -> list[int]:
    """Speculative sampling for one sequence whose drafter sampled `draft` [k] from
    `draft_probs` [k, V]: `target_probs` [k + 1, V] are the target's processed
    distributions at the k + 1 rows. Returns the kept tokens (1 .. k + 1), distributed
    exactly as the target's own draws; reproducible from (seed, positions)."""
    k = draft.shape[0]
    positions = torch.arange(first_position, first_position + k + 1, dtype=torch.int64)
    seeds = torch.full_like(positions, seed)
    u = uniforms(seeds, positions)
    noise = gumbel_noise(seeds, positions, target_probs.shape[-1])
    rows = torch.arange(k)
    p = target_probs[rows, draft]
    q = draft_probs[rows, draft]
    accept = (u[:k] * q <= p).tolist()
    kept: list[int] = []
    for j in range(k):
        if accept[j]:
            kept.append(int(draft[j]))
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: any rejection is of mass 0; draw from p
            residual = target_probs[j]
        kept.append(int((residual.log() + noise[j]).argmax()))
        return kept
    kept.append(int((target_probs[k].log() + noise[k]).argmax()))
    return kept
