"""An EAGLE-3 head in the graph generator: the head on the model's device and in its
dtype, its one-layer KV arena, its step buffers and its graphs, through a `GraphRunner`
of its own, served as the draft model is (`DraftRunner`: decode graphs per batch bucket
before ready, the catch-up's prefill and mixed buckets in the background, within the
draft's share of the graph memory budget, on the target's serving stream; eager on the
CPU, where the head computes in float32 as the whole CPU path does).

The graph runner runs models; `HeadStep` is the head as one. Beside the step buffers'
token inputs a head step reads, at fixed addresses of its own, each row's RoPE position
(its true position; the KV's positions count from the sequence's origin in the head's
cache, `eagle3`) and its hidden input: for a prefill-shaped step (the catch-up over the
target's states) the target's three layers' states, mixed down by `fc` inside the
graph; for a decode step (a further draft token) the head's own previous output. Each
logits row of its output holds the head's logits and, after them, its output before
the final norm (the next draft step's hidden input), so that warm-ups, which write to
scratch outputs, leave the live ones alone. The drafter (`Eagle3Drafter`, the in-process
engine's code) runs its forwards through `GraphHeadForward`; the target's states it
reads are copied, on the device, from the target's step buffers (`aux_hidden`) after
each step's forward, the rows the `Step` names.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridd.eagle3_head import Eagle3HeadSpec
from hybridd.engine.sampler import Sampler
from hybridd.engine.speculation.draft_runner import DraftRunner
from hybridd.engine.speculation.eagle3 import Eagle3Drafter
from hybridd.kernels.ops import TorchKernels
from hybridd.model.eagle3 import Eagle3Head
from hybridd.model.kv_cache import KVCache, blocks_for
from hybridd.model.step_inputs import HostStepInputs, StepInputs
from hybridd.runtime.buckets import BucketPlan
from hybridd.runtime.graph_runner import GraphRunner
from hybridd.runtime.step_buffers import StepBuffers


@dataclass(frozen=True)
class HeadGeometry:
    """A head step's sizes as the graph runner plans with them (`graph_memory`): its
    output row (`vocab_size`) is the logits and the output before the final norm."""

    hidden_size: int
    intermediate_size: int
    q_size: int
    kv_size: int
    vocab_size: int

    @classmethod
    def of(cls, spec: Eagle3HeadSpec) -> HeadGeometry:
        # The attention's projections read two hidden sizes, and fc three target ones.
        return cls(hidden_size=3 * spec.target_hidden_size, intermediate_size=spec.intermediate_size,
                   q_size=spec.num_heads * spec.head_dim, kv_size=spec.num_kv_heads * spec.head_dim,
                   vocab_size=spec.draft_vocab_size + spec.hidden_size)


class HeadStep:
    """The head as its graph runner's model (see the module docstring)."""

    kernels = TorchKernels()  # the head's forward is plain torch

    def __init__(self, head: Eagle3Head, max_tokens: int) -> None:
        spec = head.spec
        self.head = head
        self.device, self.dtype = head.device, head.dtype
        self.config = HeadGeometry.of(spec)
        self.draft_vocab_size = spec.draft_vocab_size
        self.rope_positions = torch.zeros(max_tokens, dtype=torch.int64, device=head.device)
        self.states = torch.zeros((max_tokens, 3 * spec.target_hidden_size), dtype=head.dtype, device=head.device)
        self.hidden = torch.zeros((max_tokens, spec.hidden_size), dtype=head.dtype, device=head.device)

    def __call__(self, step: StepInputs, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        t = step.num_tokens
        hidden = self.head.combine(self.states[:t]) if step.is_prefill else self.hidden[:t]
        return self.head(step, kv_cache, hidden, self.rope_positions[:t])

    def compute_logits(self, outputs: tuple[torch.Tensor, torch.Tensor], logits_indices: torch.Tensor) -> torch.Tensor:
        """Per logits row: the head's logits, then its output before the final norm (float32)."""
        normed, out = outputs
        return torch.cat([self.head.compute_logits(normed.index_select(0, logits_indices)),
                          out.index_select(0, logits_indices).float()], dim=-1)


class GraphHeadForward:
    """The head's forwards through its graph runner: a step's inputs written to the
    runner's buffers and the head step's own, replayed from its bucket's graph (or run
    eagerly), its logits rows read back (`eagle3.HeadForward`)."""

    def __init__(self, runner: GraphRunner, step: HeadStep) -> None:
        self.runner = runner
        self.step = step
        self.max_tokens = runner.buffers.max_tokens
        self.max_seqs = runner.buffers.max_seqs

    def __call__(self, inputs: HostStepInputs, rope: np.ndarray, hidden: torch.Tensor,
                 tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = inputs.num_logit_rows
        self.write(inputs, rope, hidden, tokens)
        self.runner.run(inputs.is_prefill, inputs.num_tokens, rows)
        out = self.runner.buffers.logits[:rows]
        vocab = self.step.draft_vocab_size
        return out[:, :vocab], out[:, vocab:].to(self.step.dtype)

    def write(self, inputs: HostStepInputs, rope: np.ndarray, hidden: torch.Tensor,
              tokens: torch.Tensor | None = None) -> None:
        """A step's inputs into the runner's buffers and the head step's own (on the serving
        stream, which the drafter's thread has made its own: `hidden` and `tokens`, made
        on it, are ready in its order); `tokens`, on the device, in place of `inputs`'."""
        step, t = self.step, inputs.num_tokens
        with self.runner.serving.entered():
            self.runner.buffers.write(inputs)
            if tokens is not None:
                self.runner.buffers.input_ids[:t].copy_(tokens)
            positions = torch.from_numpy(np.asarray(rope, dtype=np.int64))
            if step.device.type == "cuda":  # a pageable copy would wait for the stream
                positions = positions.pin_memory()
            step.rope_positions[:t].copy_(positions, non_blocking=True)
            (step.states if inputs.is_prefill else step.hidden)[:t].copy_(hidden)


def eagle3_runner(head: Eagle3Head, kv: KVCache, plan: BucketPlan, max_tokens: int, *,
                  use_graphs: bool, memory_budget_bytes: int, stream: torch.cuda.Stream | None) -> DraftRunner:
    """The head served: `kv` its KV arena (`Eagle3Head.allocate_kv`), its step buffers of
    `max_tokens` tokens and `plan`'s rows, its graphs for `plan`'s buckets within
    `memory_budget_bytes`, on `stream` (the target's serving stream)."""
    num_blocks, block_size = kv.num_blocks, kv.block_size
    step = HeadStep(head, max_tokens)
    buffers = StepBuffers.allocate(max_tokens, plan.max_rows, blocks_for(head.max_positions, block_size),
                                   step.config.vocab_size, head.device)
    runner = GraphRunner(step, kv, buffers, plan, use_graphs=use_graphs,  # type: ignore[arg-type]
                         memory_budget_bytes=memory_budget_bytes, stream=stream)
    drafter = Eagle3Drafter(head, num_blocks, block_size, sampler=Sampler(compile=False),
                            forward=GraphHeadForward(runner, step))
    return DraftRunner(drafter, runner, kv, None)
