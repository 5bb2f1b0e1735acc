"""The torch prefill attention over the paged context against dense causal attention:
rows that start at any position (a prompt's later chunks, decode rows in a mixed step),
with bucket padding, GQA and a sliding window."""

from __future__ import annotations

import random

import pytest
import torch

from hybridd.kernels import attention
from hybridd.model.step_inputs import StepInputs
from tests.paged_steps import dense_causal, paged_step


# The CPU's path (each sequence's keys gathered once, bounds read on the host) and the
# graph-safe one (every bound on the device), each against dense causal attention.
PATHS = pytest.mark.parametrize("prefill", [attention.prefill_attention, attention.prefill_attention_graph_safe],
                                ids=["by_sequence", "graph_safe"])


@PATHS
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_paged_prefill_matches_dense_causal_attention_from_any_start(prefill, seed, heads, kv_heads):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    d = 32
    spans = [(rng.choice([0, rng.randint(1, 250)]), rng.choice([1, rng.randint(1, 80)]))
             for _ in range(rng.randint(1, 6))]
    step, q, kc, vc, contexts = paged_step(g, "cpu", torch.float32, spans, heads, kv_heads, d,
                                           page=rng.choice([4, 16]), pad=rng.randint(0, 9),
                                           padded_seqs=rng.randint(0, 2))
    out = prefill(q, kc, vc, step, d**-0.5)
    torch.testing.assert_close(out, dense_causal(q, spans, contexts, d**-0.5), rtol=1e-5, atol=1e-5)


@PATHS
def test_paged_prefill_with_a_sliding_window(prefill):
    g = torch.Generator().manual_seed(1)
    spans = [(0, 40), (100, 30), (77, 1)]
    step, q, kc, vc, contexts = paged_step(g, "cpu", torch.float32, spans, 4, 2, 16, page=8, pad=5)
    out = prefill(q, kc, vc, step, 0.25, sliding_window=24)
    torch.testing.assert_close(out, dense_causal(q, spans, contexts, 0.25, sliding_window=24), rtol=1e-5, atol=1e-5)


def test_a_chunked_prompt_attends_as_the_whole_prompt_does():
    """The rows of a prompt prefilled in three chunks equal those of its whole prefill."""
    g = torch.Generator().manual_seed(2)
    step, q, kc, vc, _ = paged_step(g, "cpu", torch.float32, [(0, 100)], 4, 2, 16, page=16)
    whole = attention.prefill_attention(q, kc, vc, step, 0.25)
    table = step.block_tables[0].tolist()
    for lo, hi in ((0, 37), (37, 64), (64, 100)):
        chunk = StepInputs.prefill([[1] * (hi - lo)], [table], 16, start_positions=[lo], table_width=len(table))
        torch.testing.assert_close(attention.prefill_attention(q[lo:hi], kc, vc, chunk, 0.25), whole[lo:hi])
