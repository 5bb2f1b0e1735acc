"""On the GPU: chunked-prefill steps with a decode row for each of a full batch of
streams beside a prompt chunk replay captured prefill graphs, bitwise equal to the eager
path on the same padded inputs, KV cache included."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu_graph_runner import BLOCK, DECODE, PREFILL, Seqs, make_runner, model, run_both  # noqa: F401

pytestmark = pytest.mark.gpu


@torch.inference_mode()
def test_full_batch_mixed_steps_replay_mixed_graphs(model):  # noqa: F811
    from hybridd.model import StepInputs

    graphs, eager = make_runner(model, True), make_runner(model, False)
    graphs.capture_decode_graphs()
    for kind, size in [("prefill", s) for s in PREFILL] + [("mixed", s) for s in graphs.plan.mixed]:
        assert graphs._capture(kind, size)
    streams = max(DECODE) - 1
    seqs = Seqs(streams + 1, seed=3)
    for i in range(streams):  # each prompt alone: at most 300 tokens, within the step buffers
        run_both(graphs, eager, seqs.prefill_step([i]))
    long_prompt = torch.randint(3, 32000, (600,), generator=seqs.g).tolist()
    table = seqs.tables[streams]
    for lo in range(0, 600, 200):  # three chunks of one prompt, each beside every stream's decode row
        decode = seqs.decode_step(list(range(streams)))
        tokens = [[t] for t in decode.input_ids.tolist()] + [long_prompt[lo:lo + 200]]
        starts = decode.positions.tolist() + [lo]
        step = StepInputs.prefill(tokens, seqs.tables[:streams] + [table], BLOCK, start_positions=starts)
        shape, got, ref = run_both(graphs, eager, step)
        assert shape.graph and shape.seqs == graphs.plan.max_rows and shape.bucket == 256, shape
        assert torch.equal(got, ref)
    real_blocks = graphs.kv_cache.num_blocks
    assert torch.equal(graphs.kv_cache.arena[:, :, :real_blocks], eager.kv_cache.arena[:, :, :real_blocks])
