"""On the GPU: a graph runner that also writes the hidden states an EAGLE-3 head reads
(`aux_hidden`, inside each step's graph) gives, bitwise, the eager path's states and
logits on the same padded inputs, decode and prefill graphs alike, and its logits are
those of a runner without them. The head as the graph generator runs it
(`eagle3_runner`, the shipped head on the embedded model, bfloat16): its captured decode,
prefill and mixed graphs give, bitwise, its eager steps' logits and outputs on the same
padded inputs; its drafts over the model's own hidden states are its eager runner's,
token for token; once the background capture is done, no head step runs eagerly."""

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


def _embedded_model_and_head():
    from hybridd.config import EMBEDDED_EAGLE3_HEAD, EMBEDDED_MODEL
    from hybridd.model import load_model
    from hybridd.model.eagle3 import load_eagle3_head

    model = load_model(EMBEDDED_MODEL, dtype=torch.bfloat16, device="cuda", max_positions=1024)
    head = load_eagle3_head(EMBEDDED_EAGLE3_HEAD, model.config, EMBEDDED_MODEL, model.embed_tokens, 1024,
                            dtype=torch.bfloat16, device="cuda")
    return model, head


def _target_states(model, head, tokens: list[int]):
    """The model's states in the head's layers at every position of `tokens` [len, 3 x hidden]."""
    from hybridd.model import KVCache
    from hybridd.model.kv_cache import blocks_for
    from hybridd.model.step_inputs import HostStepInputs

    blocks = blocks_for(len(tokens), BLOCK)
    kv = KVCache.allocate(model.config, blocks, BLOCK, model.dtype, "cuda")
    step = HostStepInputs.prefill([tokens], [list(range(blocks))], BLOCK).on("cuda")
    return model.forward_aux(step, kv, head.spec.aux_layers)[1]


@torch.inference_mode()
def test_the_heads_captured_steps_equal_its_eager_steps_bitwise():
    import numpy as np

    from hybridd.model.step_inputs import HostStepInputs
    from tests.speculation_helpers import ServedEagle3

    model, head = _embedded_model_and_head()
    graphs, eager = ServedEagle3(head, 256, BLOCK), ServedEagle3(head, 256, BLOCK, use_graphs=False)
    runner = graphs.runner.runner
    for kind, sizes in (("prefill", runner.plan.prefill), ("mixed", runner.plan.mixed)):
        for size in sizes:
            assert runner._capture(kind, size), runner.stats[(kind, size)].to_dict()
    g = torch.Generator().manual_seed(5)
    lengths = [30, 9, 20]  # the three make a mixed step of 59 tokens: within the mixed buckets
    tokens = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(lengths))]
    states = torch.cat([_target_states(model, head, t) for t in tokens])
    steps = [(HostStepInputs.prefill(tokens[:2], tables[:2], BLOCK), states[:sum(lengths[:2])]),
             (HostStepInputs.prefill(tokens, tables, BLOCK), states)]  # three sequences: a mixed step
    width = head.spec.hidden_size
    for n in (1, 2, 3):
        steps.append((HostStepInputs.decode([7 + i for i in range(n)], lengths[:n], tables[:n], BLOCK),
                       torch.randn(n, width, generator=g).to("cuda", torch.bfloat16)))
    torch.cuda.synchronize()  # the inputs, made on the default stream, before the runners' streams read them
    for inputs, hidden in steps:
        rope = inputs.positions.astype(np.int64)
        rows = inputs.num_logit_rows
        forward = graphs.runner.drafter.forward
        forward.write(inputs, rope, hidden)
        shape = runner.run(inputs.is_prefill, inputs.num_tokens, rows)
        assert shape.graph, shape
        eager.runner.drafter.forward.write(inputs, rope, hidden)
        assert not eager.runner.runner.run(shape.is_prefill, shape.tokens, shape.seqs).graph
        runner.stream.synchronize()
        eager.runner.runner.stream.synchronize()
        got, ref = runner.buffers.logits[:rows], eager.runner.runner.buffers.logits[:rows]
        assert torch.equal(got, ref), (shape, (got - ref).abs().max())
        assert got.abs().sum() > 0


@torch.inference_mode()
def test_the_heads_drafts_equal_its_eager_runners_with_no_eager_step_in_steady_state():
    from hybridd.engine.sequence import Sequence
    from hybridd.protocol import control
    from hybridd.protocol.messages import SamplingParams
    from tests.speculation_helpers import ServedEagle3, keep_drafts, no_eager_step_once_captured, repetitive_prompts

    model, head = _embedded_model_and_head()
    served = [ServedEagle3(head, 256, BLOCK), ServedEagle3(head, 256, BLOCK, use_graphs=False)]
    params = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)
    prompts = repetitive_prompts((40, 90, 25, 60), seed=2, vocab=4096)
    seqs = [[Sequence(str(i), p, params) for i, p in enumerate(prompts)] for _ in served]

    def process(start: list[int], rows: list[list[int]]) -> None:
        """The target ran `rows` of each sequence from position `start[i]`."""
        states = [_target_states(model, head, seq.token_ids[:a] + r)[a:] for seq, a, r in
                  zip(seqs[0], start, rows, strict=True)]
        named, at = [], 0
        for seq, a, r in zip(seqs[0], start, rows, strict=True):
            named.append(control.HiddenRows(request_id=seq.request_id, start=a, row=at, tokens=r))
            at += len(r)
        hidden = torch.cat(states)
        torch.cuda.synchronize()  # made on the default stream; the runners copy it on theirs
        for s in served:
            s.observe(named, hidden)

    process([0] * len(prompts), prompts)
    for group in seqs:
        for seq in group:
            seq.output_token_ids.append(seq.prompt_token_ids[-1])

    def rounds(n: int, first: int) -> None:
        for r in range(first, first + n):
            got = [s.drafter.propose(group, [4] * len(group)) for s, group in zip(served, seqs, strict=True)]
            assert [d.tokens for d in got[0]] == [d.tokens for d in got[1]], r
            process([len(seq) - 1 for seq in seqs[0]], [[seq.token_ids[-1], *d.tokens] for seq, d in
                                                        zip(seqs[0], got[0], strict=True)])
            keep_drafts(seqs, got, r % 4)

    rounds(6, 0)
    assert sum(s.replays for (kind, _), s in served[0].runner.runner.stats.items() if kind == "decode") > 0
    assert served[0].runner.drafts > 0
    no_eager_step_once_captured(served[0].runner.runner, lambda: rounds(6, 6), "head")
