"""Penalty batches pipeline like any other: the context generator launches the next step
before it has collected the last one's tokens, the in-flight token is counted on the
device (`SamplingTensors.record`), and the tokens equal a plain host-side reference;
the steps that have landed are retired while the next one launches.

The graph generator is a real worker process; the context generator runs in this
process, driven step by step through its engine core (`core.step()`)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL, Config
from hybridd.protocol.messages import SamplingParams
from hybridd.engine.sequence import Sequence
from hybridd.model import KVCache, StepInputs, load_model, load_tokenizer
from hybridd.workers import graph_generator
from hybridd.workers.context_generator import ContextGenerator

pytestmark = pytest.mark.slow

PENALTIES = [
    SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3),
    SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=0.6, presence_penalty=0.4),
    SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.3),
]
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "HAMLET:\nTo be, or not to be"]


@torch.inference_mode()
def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with the penalties applied on the host, one full forward per token,
    until max_tokens or an end-of-sequence token."""
    output: list[int] = []
    for _ in range(params.max_tokens):
        ids = prompt + output
        kv = KVCache.allocate(model.config, -(-len(ids) // 16), 16, torch.float32, "cpu")
        step = StepInputs.prefill([ids], [list(range(kv.num_blocks))], 16)
        logits = model.forward_logits(step, kv)[0].double()
        seen = set(ids)
        for token in seen:  # repetition (HF): prompt and output tokens
            value = logits[token]
            logits[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for token in set(output):  # frequency and presence (OpenAI): output tokens
            logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
        output.append(int(logits.argmax()))
        if output[-1] in model.config.eos_token_ids:
            break
    return output


def run_until_idle(worker, most_steps: int) -> None:
    """Drive the context generator's loop step by step until nothing is queued or in flight."""
    for _ in range(most_steps):
        if not worker.core.has_work:
            return
        worker.core.step()


@pytest.fixture
def context_generator(tmp_path):
    # Without speculation: a speculating step waits for the tokens before it, and these
    # tests are about the steps that run a step ahead of them.
    config = Config.from_dict({"runtime_dir": str(tmp_path), "compile_sampler": False, "log_level": "warning",
                               "device": "cpu", "dtype": "float32", "speculative_drafter": "none"})
    ctl = f"ipc://{tmp_path}/ctl-penalty.sock"
    graph = mp.get_context("spawn").Process(target=graph_generator.main, args=(config.to_dict(), ctl), daemon=True)
    worker = ContextGenerator(config, ctl, supervised=False)
    graph.start()
    try:
        worker.start()
        yield worker
    finally:
        worker.close()
        graph.join(30)
        if graph.is_alive():
            graph.kill()


def test_penalty_batches_pipeline_and_match_the_host_reference(context_generator):
    worker = context_generator
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    seqs = [Sequence(f"r{i}", ids, params) for i, (ids, params) in enumerate(zip(prompts, PENALTIES, strict=True))]
    for seq in seqs:
        worker.scheduler.add(seq)
    # Steps still in flight at each launch, seen through the real launch.
    behind: list[int] = []
    launch = worker.pipeline.launch

    def launch_and_count(batch):
        behind.append(len(worker.core.inflight))
        return launch(batch)

    worker.pipeline.launch = launch_and_count
    run_until_idle(worker, 1000)
    assert all(seq.is_finished for seq in seqs)
    # Every decode step was launched before the host had collected the step before it.
    assert behind[0] == 0 and all(n == 1 for n in behind[1:]) and len(behind) > 10, behind

    model = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    for seq, ids, params in zip(seqs, prompts, PENALTIES, strict=True):
        assert seq.output_token_ids == reference(model, ids, params), seq.request_id


def test_landed_tokens_are_retired_while_the_next_step_launches(context_generator):
    """A step's tokens go to the client while the graph generator launches the next step,
    not after it: on the CPU, where every step has landed when its launch returns, the
    host has every earlier token by the time it waits for the next step's launch."""
    worker = context_generator
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    seq = Sequence("r0", tokenizer.encode("ROMEO:"), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    worker.scheduler.add(seq)
    seen: list[tuple[int, int]] = []  # (step, tokens on the host) when the host waits for its launch
    await_launched = worker.pipeline._await_launched

    def recording(step_id):
        seen.append((step_id, seq.num_output_tokens))
        return await_launched(step_id)

    worker.pipeline._await_launched = recording
    run_until_idle(worker, 100)
    assert seq.is_finished and seq.num_output_tokens == 6
    assert seen == [(step, step) for step in range(6)], seen
