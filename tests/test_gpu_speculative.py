"""On the GPU: speculative decoding's verify steps replay the decode graphs (a verify
step is a decode step of k + 1 rows per sequence), and each verify step's graph gives
the logits, so the tokens, of the eager path on the same padded inputs, bitwise; in
steady state no step runs eagerly."""

from __future__ import annotations

import pytest
import torch

from hybridd.engine.in_process_runner import LandedSteps
from tests.speculation_helpers import keep_drafts, no_eager_step_once_captured, repetitive_prompts
from tests.test_gpu_graph_runner import load_model_for_runner, make_runner

pytestmark = pytest.mark.gpu


class CheckedGraphRunner(LandedSteps):
    """The engine core's runner over a graph runner in this process, which runs every
    step a second time eagerly on the same padded inputs (its own runner, its own KV
    cache kept in step) and checks that the logits are the graph's."""

    def __init__(self, graphs, eager, sampler) -> None:
        super().__init__(sampler, torch.device("cuda"))
        self.graphs, self.eager = graphs, eager
        self.verify_steps = 0

    def launch(self, batch):
        rows = batch.num_rows
        with torch.cuda.stream(self.graphs.stream):
            self.graphs.buffers.write(batch.inputs)
        shape = self.graphs.run(batch.is_prefill, batch.num_tokens, rows)
        with torch.cuda.stream(self.eager.stream):
            self.eager.buffers.write(batch.inputs)
        assert not self.eager.run(shape.is_prefill, shape.tokens, shape.seqs).graph
        self.graphs.stream.synchronize()
        self.eager.stream.synchronize()
        logits = self.graphs.buffers.logits[:rows].clone()
        assert torch.equal(logits, self.eager.buffers.logits[:rows]), (batch.kind, rows)
        if batch.is_verify:
            self.verify_steps += 1
            assert shape.graph, f"a verify step of {rows} rows ran eagerly"
        return self.sample(batch, logits)


@torch.inference_mode()
def test_verify_steps_replay_decode_graphs_equal_to_eager():
    from hybridd.engine.block_manager import BlockManager
    from hybridd.engine.core import EngineCore
    from hybridd.engine.sampler import Sampler
    from hybridd.engine.scheduler import Scheduler
    from hybridd.engine.speculation.ngram import NgramDrafter
    from hybridd.engine.speculation.policy import SpeculationPolicy
    from hybridd.engine.speculation.speculator import Speculator
    from hybridd.protocol.messages import SamplingParams

    model = load_model_for_runner()
    graphs, eager = make_runner(model, True), make_runner(model, False)
    graphs.capture_decode_graphs()
    runner = CheckedGraphRunner(graphs, eager, Sampler(compile=True))
    prompts = repetitive_prompts((40, 90, 25, 60), seed=2, vocab=32000)
    speculator = Speculator(NgramDrafter(1, 3), 5, SpeculationPolicy(5, adaptive=False, initial_acceptance=0.9))
    blocks = BlockManager(40 * 64, 16, watermark=0.0)
    scheduler = Scheduler(blocks, max_batch=4, max_prefill_tokens=512, max_model_len=1024, block_table_width=64,
                          speculator=speculator, max_verify_rows=graphs.plan.max_batch)
    core = EngineCore(scheduler, runner, pipeline_depth=1)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add(str(i), prompt, params)
    while core.has_work:
        core.step()
    assert runner.verify_steps > 10 and speculator.stats.draft_tokens > 0
    decode = [s for (kind, _), s in graphs.stats.items() if kind == "decode"]
    assert sum(s.replays for s in decode) > 0
    assert sum(s.eager_runs for s in decode) == 0


def _draft_runner(model, use_graphs: bool):
    from hybridd.engine.speculation.draft_runner import draft_model_runner
    from hybridd.model import KVCache
    from hybridd.model.kv_cache import blocks_for
    from hybridd.runtime.buckets import BucketPlan
    from hybridd.runtime.step_buffers import StepBuffers

    plan = BucketPlan.create([1, 2, 4, 8], [16, 32, 64, 128, 256], max_prefill_seqs=2, mixed_tokens=256)
    vocab = model.config.vocab_size
    buffers = StepBuffers.allocate(256, plan.max_rows, blocks_for(model.max_positions, 16), vocab, "cuda")
    kv = KVCache.allocate(model.config, 512, 16, model.dtype, "cuda")
    probabilities = torch.zeros(plan.max_batch, vocab, device="cuda")
    runner = draft_model_runner(model, kv, buffers, plan, probabilities, use_graphs=use_graphs,
                                memory_budget_bytes=1 << 30, stream=None)
    runner.runner.capture_decode_graphs()
    runner.runner.warm_up_prefill()
    return runner


@torch.inference_mode()
def test_draft_model_graphs_replay_equal_to_eager_with_no_eager_step_in_steady_state():
    """The draft model's runner of the graph generator (`DraftRunner`) on CUDA: its decode
    graphs, captured per batch bucket, and its catch-up's prefill and mixed graphs,
    captured in the background, draft what its eager runner drafts, greedy, token for
    token; once the background capture is done, no draft step runs eagerly."""
    from hybridd.config import EMBEDDED_DRAFT_MODEL
    from hybridd.engine.sequence import Sequence
    from hybridd.engine.speculation.graph_drafter import GraphDrafter
    from hybridd.model import load_model
    from hybridd.protocol.messages import SamplingParams

    model = load_model(EMBEDDED_DRAFT_MODEL, dtype=torch.bfloat16, device="cuda", max_positions=1024)
    graphs, eager = _draft_runner(model, True), _draft_runner(model, False)
    drafters = [GraphDrafter(r.draft, r.draft, r.probabilities) for r in (graphs, eager)]
    params = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)
    prompts = repetitive_prompts((40, 90, 25, 60), seed=2, vocab=4096)
    seqs = [[Sequence(str(i), p, params) for i, p in enumerate(prompts)] for _ in drafters]

    def rounds(n: int, first: int) -> None:
        for r in range(first, first + n):
            got = [d.propose(s, [4] * len(s)) for d, s in zip(drafters, seqs, strict=True)]
            assert [d.tokens for d in got[0]] == [d.tokens for d in got[1]], r
            keep_drafts(seqs, got, r % 4)

    rounds(6, 0)
    assert sum(s.replays for (kind, _), s in graphs.runner.stats.items() if kind == "decode") > 0
    no_eager_step_once_captured(graphs.runner, lambda: rounds(6, 6), "draft")
