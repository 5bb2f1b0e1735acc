"""Allowed-token bitmasks: which tokens each row of a step may draw.

A bitmask is int32 [rows, ceil(V / 32)]: bit b of word w allows token 32·w + b; a row of
-1 words allows every token. It is the one way a constraint reaches sampling: the host
fills it (structured output's grammars, `hybridd.engine.grammar`) and the sampler applies
it to the logits before anything else, outside the CUDA graphs, so it composes with
penalties, temperature, top-k/top-p, seeds and logprobs (which then come from the
constrained distribution), and with any number of rows per sequence.
"""

from __future__ import annotations

import torch

BITS = 32


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def allow_all(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, V]: the bitmask's bits, token by token."""
    bits = torch.arange(BITS, device=bitmask.device, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The logits with every token the bitmask does not allow at -inf (a new tensor: the
    logits region the forward wrote is left as it is)."""
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))
