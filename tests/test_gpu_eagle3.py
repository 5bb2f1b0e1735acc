"""On the GPU: a graph runner that also writes the hidden states an EAGLE-3 head reads
(`aux_hidden`, inside each step's graph) gives, bitwise, the eager path's states and
logits on the same padded inputs, decode and prefill graphs alike, and its logits are
those of a runner without them."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu_graph_runner import BLOCK, DECODE, PREFILL, Seqs, load_model_for_runner, make_runner, run_both

pytestmark = pytest.mark.gpu


def aux_runner(model, use_graphs: bool):
    from hybridd.eagle3_head import default_aux_layers
    from hybridd.model import KVCache
    from hybridd.runtime.buckets import BucketPlan
    from hybridd.runtime.graph_runner import GraphRunner
    from hybridd.runtime.step_buffers import StepBuffers

    layers = default_aux_layers(model.config.num_layers)
    plan = BucketPlan.create(list(DECODE), list(PREFILL), max_prefill_seqs=4)
    kv = KVCache.allocate(model.config, 40 * 64, BLOCK, torch.bfloat16, "cuda")
    buffers = StepBuffers.allocate(plan.max_prefill_tokens, plan.max_rows, 64, model.config.vocab_size, "cuda",
                                   (3 * model.config.hidden_size, model.dtype))
    return GraphRunner(model, kv, buffers, plan, use_graphs=use_graphs, aux_layers=layers)


@torch.inference_mode()
def test_graphs_write_the_heads_hidden_states_as_eager_does():
    model = load_model_for_runner()
    graphs, eager, plain = aux_runner(model, True), aux_runner(model, False), make_runner(model, False)
    graphs.capture_decode_graphs()
    for size in PREFILL:
        assert graphs._capture("prefill", size)
    seqs = Seqs(8, seed=3)
    seqs.lengths = [min(n, 40) for n in seqs.lengths]
    seqs.tokens = [t[:n] for t, n in zip(seqs.tokens, seqs.lengths)]
    for step in (seqs.prefill_step([0, 1]), seqs.decode_step([0, 1]), seqs.decode_step(list(range(2))),
                 seqs.decode_step([0])):
        shape, got, ref = run_both(graphs, eager, step)
        assert shape.graph and torch.equal(got, ref)
        with torch.cuda.stream(plain.stream):
            plain.buffers.write(step)
        plain.run(shape.is_prefill, shape.tokens, shape.seqs)
        plain.stream.synchronize()
        assert torch.equal(plain.buffers.logits[:step.num_seqs], ref)
        rows = step.num_tokens
        assert torch.equal(graphs.buffers.aux_hidden[:rows], eager.buffers.aux_hidden[:rows])
        assert graphs.buffers.aux_hidden[:rows].abs().sum() > 0
