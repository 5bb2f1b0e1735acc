"""A drafter in the graph generator: the draft model (or an EAGLE-3 head, `eagle3_runner`)
on the target's device, its KV arena, its step buffers, and its graphs, through a
`GraphRunner` of its own (decode graphs per batch bucket captured before ready, the
catch-up's prefill and mixed buckets in the background, under its share of the graph
memory budget, replayed on the target's serving stream). Without CUDA the same runner
runs every step eagerly.

The context generator asks for drafts with a `control.Draft` message (`graph_drafter`
is its side): per sequence, the tokens the graph generator has not seen yet (a
sequence's tokens only grow: prompt, then kept output; the rejected draft tokens are
the draft cache's, never the sequence's), its sampling parameters and seed, and how
many draft tokens it wants; and the sequences that finished. `DraftRunner.draft` keeps
each sequence's tokens (`_Tokens`), runs the drafter (`DraftModelDrafter`, the same
code as the in-process reference, over `GraphForward`) and answers `control.Drafted`
with the tokens; a sampled request's draft distributions go into the shared
`probabilities` region (a row per draft token), since no tensor travels through ZeroMQ.

`DraftRunner` serves any drafter whose forwards run through its graph runner (a
`ServedDrafter`): the draft model's (`draft_model_runner`) and an EAGLE-3 head's, which
is also handed the rows of the target's hidden states each `Step` names (`observe`),
from the target's step buffers in this process. `DraftServer` is what the graph
generator asks of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from hybridd.engine.sampler import Sampler
from hybridd.engine.speculation.draft_model import DraftedSequence, DraftModelDrafter
from hybridd.engine.speculation.drafter import Draft, HiddenStateDrafter
from hybridd.log import get_logger
from hybridd.model.kv_cache import KVCache
from hybridd.model.llama import LlamaModel
from hybridd.model.step_inputs import HostStepInputs
from hybridd.protocol import control
from hybridd.protocol.messages import SamplingParams
from hybridd.runtime.buckets import BucketPlan
from hybridd.runtime.graph_runner import GraphRunner
from hybridd.runtime.step_buffers import StepBuffers

log = get_logger("draft_runner")


class DraftServer(Protocol):
    """What the graph generator asks of the drafter it runs."""

    def capture(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture the graphs wanted before ready (and compile what serving would)."""
        ...

    def start_background_capture(self) -> None: ...

    def stop_background_capture(self) -> None: ...

    def serve_from_this_thread(self) -> None:
        """Run this thread's draft steps on the serving stream without a switch each."""
        ...

    def draft(self, message: control.Draft) -> control.Drafted | None:
        """The answer to a `Draft` (None: it asks for nothing, and gets no answer)."""
        ...

    def observe(self, step: control.Step, hidden: torch.Tensor | None) -> None:
        """The rows `step` names of its hidden states `hidden`, for a drafter that reads them."""
        ...

    def snapshot(self) -> dict:
        """Its part of the status: KV, graphs, counters."""
        ...


class ServedDrafter(Protocol):
    """A drafter whose forwards run through a `DraftRunner`'s graph runner."""

    def propose(self, seqs: list[DraftedSequence], max_tokens: list[int]) -> list[Draft]: ...

    def release(self, request_id: str) -> None: ...

    def kv_blocks(self) -> dict[str, int]:
        """Its KV cache's blocks: total, free, block_size."""
        ...


class GraphForward:
    """The draft model's forwards through its graph runner: a step written to the runner's
    buffers, replayed from its bucket's graph (or run eagerly), its logits rows read back."""

    def __init__(self, runner: GraphRunner) -> None:
        self.runner = runner
        self.max_tokens = runner.buffers.max_tokens
        self.max_seqs = runner.buffers.max_seqs

    def __call__(self, inputs: HostStepInputs, tokens: torch.Tensor | None = None) -> torch.Tensor:
        rows = inputs.num_logit_rows
        with self.runner.serving.entered():
            self.runner.buffers.write(inputs)
            if tokens is not None:
                self.runner.buffers.input_ids[:inputs.num_tokens].copy_(tokens)
        self.runner.run(inputs.is_prefill, inputs.num_tokens, rows)
        return self.runner.buffers.logits[:rows]


class _Tokens:
    """A sequence as the graph generator knows it: its tokens so far, its sampling."""

    def __init__(self, request_id: str, params: SamplingParams, seed: int, prompt_len: int) -> None:
        self.request_id = request_id
        self.params = params
        self.seed = seed
        self.prompt_len = prompt_len
        self.token_ids: list[int] = []

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    def __len__(self) -> int:
        return len(self.token_ids)


class DraftRunner:
    def __init__(self, drafter: ServedDrafter, runner: GraphRunner, kv_cache: KVCache,
                 probabilities: torch.Tensor | None) -> None:
        """`runner`: the graph runner `drafter`'s forwards run through, on `kv_cache` (its
        arena); `probabilities`: the shared region [rows, V] for sampled drafts'
        distributions (None: the drafter gives none)."""
        self.drafter = drafter
        self.runner = runner
        self.kv_cache = kv_cache
        self.probabilities = probabilities
        self.sequences: dict[str, _Tokens] = {}
        self.drafts = 0
        self.draft_tokens = 0

    def capture(self, progress: Callable[[int, int], None] | None = None) -> None:
        """The drafter's decode graphs, one per batch bucket (largest first), and its
        prefill kernels compiled: its catch-up forwards' graphs come in the background."""
        self.runner.capture_decode_graphs(progress=progress)
        self.runner.warm_up_prefill()

    def start_background_capture(self) -> None:
        self.runner.start_background_capture()

    def stop_background_capture(self) -> None:
        self.runner.stop_background_capture()

    def serve_from_this_thread(self) -> None:
        self.runner.serve_from_this_thread()

    def observe(self, step: control.Step, hidden: torch.Tensor | None) -> None:
        """The rows `step` names of the target's hidden states `hidden`, and its forks, to
        the drafter (on the serving stream, after the step's forward: copied before the
        next one writes over them)."""
        if not (step.hidden or step.forks) or not isinstance(self.drafter, HiddenStateDrafter):
            return
        try:
            rows = 0 if hidden is None else min(step.n_tokens, hidden.shape[0])
            for entry in step.hidden:
                if entry.row + len(entry.tokens) > rows:
                    raise ValueError(f"step {step.step}: rows {entry.row}..{entry.row + len(entry.tokens) - 1} of "
                                     f"sequence {entry.request_id!r} past the step's {rows}")
            with self.runner.serving.entered():
                for entry in step.hidden:
                    self.drafter.observe(entry.request_id, entry.start, entry.tokens,
                                         hidden[entry.row:entry.row + len(entry.tokens)])
                for fork in step.forks:
                    self.drafter.fork(fork.parent, fork.child)
        except Exception as exc:  # those sequences draft once new states come: a drafter costs speed only
            log.error("hidden_states_not_kept", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            for request_id in [entry.request_id for entry in step.hidden] + [fork.child for fork in step.forks]:
                self.drafter.release(request_id)

    def draft(self, message: control.Draft) -> control.Drafted | None:
        """Drafts for the message's sequences (see the module docstring). A message that
        does not follow what this runner knows (a sequence's tokens from another offset),
        or whose drafting fails, gets no drafts, and its sequences are forgotten: the
        context generator sends them whole next time. A message with no sequences only
        lets finished ones go, and gets no answer (None)."""
        for request_id in message.released:
            self.sequences.pop(request_id, None)
            self.drafter.release(request_id)
        if not message.sequences:
            return None
        try:
            seqs = [self._extend(entry) for entry in message.sequences]
            wanted = [entry.count for entry in message.sequences]
            if not any(wanted):
                return control.Drafted(draft=message.draft, tokens=[[] for _ in seqs], rows=[-1] * len(seqs))
            tokens, rows = self._propose(seqs, wanted)
        except Exception as exc:  # no drafts this time: a drafter costs speed only, never output
            log.error("draft_failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            for entry in message.sequences:
                self.sequences.pop(entry.request_id, None)
                self.drafter.release(entry.request_id)
            return control.Drafted(draft=message.draft, failed=True)
        self.drafts += sum(1 for t in tokens if t)
        self.draft_tokens += sum(map(len, tokens))
        return control.Drafted(draft=message.draft, tokens=tokens, rows=rows)

    def _propose(self, seqs: list[_Tokens], wanted: list[int]) -> tuple[list[list[int]], list[int]]:
        """The drafts' tokens, and each one's first row of the probabilities region (-1: none)."""
        with self.runner.serving.entered():
            drafts = self.drafter.propose(seqs, wanted)
            rows, row = [], 0
            for draft in drafts:
                if draft.probabilities is None or self.probabilities is None:
                    rows.append(-1)
                    continue
                n = len(draft)
                if row + n > self.probabilities.shape[0]:  # never within a verify step's rows
                    raise ValueError(f"draft distributions for {row + n} tokens; the region holds "
                                     f"{self.probabilities.shape[0]}")
                self.probabilities[row:row + n].copy_(draft.probabilities)
                rows.append(row)
                row += n
            if self.probabilities is not None and self.probabilities.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the reader maps this memory in another process
        return [draft.tokens for draft in drafts], rows

    def _extend(self, entry: control.DraftSequence) -> _Tokens:
        seq = self.sequences.get(entry.request_id)
        if seq is None:
            if entry.params is None or entry.first:
                raise ValueError(f"sequence {entry.request_id!r}: unknown here, and sent from token {entry.first} "
                                 f"without its sampling")
            seq = self.sequences[entry.request_id] = _Tokens(entry.request_id, entry.params, entry.seed,
                                                             entry.prompt_len)
        if entry.first != len(seq.token_ids):
            raise ValueError(f"sequence {entry.request_id!r}: tokens from {entry.first}, "
                             f"{len(seq.token_ids)} known")
        seq.token_ids.extend(entry.tokens)
        return seq

    def snapshot(self) -> dict:
        """The drafter's part of the graph generator's status: its KV arena, its graphs
        (as the target's are reported), what it drafted."""
        graphs = self.runner.snapshot()
        return {
            "kv_blocks": self.drafter.kv_blocks(),
            "kv_bytes": self.kv_cache.arena.numel() * self.kv_cache.arena.element_size(),
            "sequences": len(self.sequences),
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "graph_bytes": graphs["graph_bytes"],
            "memory_budget_bytes": graphs["memory_budget_bytes"],
            "buckets": graphs["buckets"],
        }


def draft_model_runner(model: LlamaModel, kv_cache: KVCache, buffers: StepBuffers, plan: BucketPlan,
                       probabilities: torch.Tensor, *, use_graphs: bool, memory_budget_bytes: int,
                       stream: torch.cuda.Stream | None) -> DraftRunner:
    """The draft model served: `kv_cache` its arena; `buffers` its step buffers (sized for
    `plan`); `probabilities` the shared region [rows, V] for sampled drafts'
    distributions; `stream` the target's serving stream, which the draft's steps run on too."""
    runner = GraphRunner(model, kv_cache, buffers, plan, use_graphs=use_graphs,
                         memory_budget_bytes=memory_budget_bytes, stream=stream)
    drafter = DraftModelDrafter(model, kv_cache.num_blocks, kv_cache.block_size, sampler=Sampler(compile=False),
                                forward=GraphForward(runner))
    return DraftRunner(drafter, runner, kv_cache, probabilities)
