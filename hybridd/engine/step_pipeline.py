"""The context generator's side of the overlapped step pipeline.

For each scheduled step it writes the inputs into the shared step buffers (tokens
still on the device are gathered from the ring of sampled tokens, never copied to
the host first), records `inputs_ready`, sends `Step`, does its `while_launching`
host work (the steps that have landed are retired: their tokens go to the clients
while the graph generator launches, and on the CPU runs, the next step) and waits
for `Launched` (the graph generator has *enqueued* the forward); it then enqueues sampling after
`logits_ready` on its own stream, writes the sampled tokens into the ring and a
pinned host buffer, and returns at once. The host learns the tokens later, in
`collect`, while the GPU already runs the next step. GPU ordering between the two
processes is carried by the interprocess events alone; the only host waits are on
this process's own tokens.

A batch with a constrained row (structured output) samples under an allowed-token
bitmask that depends on the token each of its sequences sampled in the step before,
which may still be on its way: once `Launched` is in (the GPU runs the forward), the
pipeline `settle`s (the caller retires every step in flight, which advances each
sequence's grammar), fills the rows' masks on the host while the forward runs, copies
them to the device and only then enqueues the sampling. Batches without one never wait.
A verify step's rows are sampled by `verification.sample_verify_rows`, a constrained
sequence's rows each under its grammar's mask after the draft tokens before it.

A prefill that forks sequences (a request's `n`) samples each fork from its row's
logits and copies the prompt's partly filled KV blocks for the forks on the same
stream, after the forward and before the next step's inputs are marked ready. Batches
with a row that asked for logprobs compute them right after the tokens and bring them
to the host with the tokens; other batches do no logprob work at all.

With a drafter that reads the model's hidden states (an EAGLE-3 head, which runs in the
graph generator beside them), each `Step` names the rows of them the head keeps
(`hidden_states.step_rows`); the graph generator copies them from its step buffers
(`StepBuffers.aux_hidden`, written by the forward) before the next step's forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridd.engine.grammar import TokenMasks
from hybridd.engine.hidden_states import step_rows
from hybridd.engine.prompt_logprobs import PromptLogprobRows
from hybridd.engine.prompt_logprobs import compute as compute_prompt_logprobs
from hybridd.engine.device_copy import to_device
from hybridd.engine.sampler import Logprobs, Sampler, SamplingTensorCache, SamplingTensors
from hybridd.errors import EngineDeadError
from hybridd.engine.scheduler import ScheduledBatch
from hybridd.engine.speculation.graph_drafter import GraphDrafter
from hybridd.engine.speculation.verification import sample_verify_rows
from hybridd.model.kv_cache import KVCache
from hybridd.runtime.serving_stream import ServingStream
from hybridd.runtime.step_buffers import StepBuffers
from hybridd.runtime.step_trace import mark
from hybridd.ipc.channel import Channel
from hybridd.ipc.events import InterprocessEvent
from hybridd.protocol import control

RING_STEPS = 4  # > pipeline depth, so a step's tokens stay until every reader has gathered them


@dataclass
class InflightStep:
    """A launched step: its batch, and its sampled tokens on their way to the host."""

    batch: ScheduledBatch
    host_tokens: torch.Tensor
    done: torch.cuda.Event | None  # the copy to the host; None on the CPU (already there)
    host_logprobs: Logprobs | None = None  # pinned host copies, when a row asked for logprobs
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)  # on the host already


class StepPipeline:
    def __init__(
        self,
        ready: control.Ready,
        buffers: StepBuffers,
        ctl: Channel[control.ControlMessage],
        sampler: Sampler,
        device: torch.device,
        on_control: Callable[[control.ControlMessage], None],
        peer_alive: Callable[[], bool],
        launch_timeout_s: float = 60.0,
        kv_cache: KVCache | None = None,
        while_launching: Callable[[], None] | None = None,
        while_waiting: Callable[[], None] | None = None,
        settle: Callable[[], None] | None = None,
    ):
        self.buffers = buffers
        self.hidden_drafter: GraphDrafter | None = None  # see feed_hidden_states
        self.kv_cache = kv_cache  # the KV arena (and an FP8 cache's scales), for copying forked blocks
        self.ctl = ctl
        self.sampler = sampler
        self.device = device
        self.vocab_size = ready.vocab_size
        self.on_control = on_control
        self.peer_alive = peer_alive
        self.launch_timeout_s = launch_timeout_s
        # Host work done while the graph generator launches a step (the context generator
        # retires the steps that have landed): it runs after the step's sampling inputs
        # are built, since retiring a step appends to the sequences' output.
        self.while_launching = while_launching
        # Called every 100 ms while a launch is awaited (the context generator's heartbeat:
        # waiting on its peer, however long the step, is not being hung).
        self.while_waiting = while_waiting
        # Retires every step in flight: a constrained batch's masks need its sequences' last tokens.
        self.settle = settle
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.serving = ServingStream(self.stream)
        self.inputs_ready = InterprocessEvent.from_handle(ready.events.get("inputs_ready", b""), device)
        self.logits_ready = InterprocessEvent.from_handle(ready.events.get("logits_ready", b""), device)
        self.ring = torch.zeros((RING_STEPS, buffers.max_seqs), dtype=torch.int64, device=device)
        self.sampling_tensors = SamplingTensorCache(device)
        self.token_masks = TokenMasks(self.vocab_size, buffers.max_seqs, pin_memory=self.cuda)

    def feed_hidden_states(self, drafter: GraphDrafter) -> None:
        """Name every step's rows of the model's hidden states to the graph generator's
        drafter that reads them (`drafter` is its side here: EAGLE-3)."""
        if self.buffers.aux_hidden is None:
            raise EngineDeadError("the drafter reads the model's hidden states and the graph generator's step "
                                  "buffers hold none")
        self.hidden_drafter = drafter

    def serve_from_this_thread(self) -> None:
        """Launch this thread's steps on the step stream without a switch each (`ServingStream`)."""
        self.serving.bind_this_thread()

    def launch(self, batch: ScheduledBatch) -> InflightStep:
        with self.serving.entered():
            return self._launch(batch)

    def _launch(self, batch: ScheduledBatch) -> InflightStep:
        n_tokens = batch.num_tokens
        on_device = batch.inputs_on_device
        # Input ids of -1 (still on the device) are overwritten by the gather below.
        self.buffers.write(batch.inputs)
        if on_device:
            self._gather_inputs(batch, n_tokens)
        self.inputs_ready.record(self.stream)
        mark("inputs_ready")
        hidden, forks = [], []
        if self.hidden_drafter is not None:
            hidden, forks = step_rows(batch, self.hidden_drafter.hidden_states_kept)
            self.hidden_drafter.observed([entry.request_id for entry in hidden] + [fork.child for fork in forks])
        mark("step_send")  # before the send: the peer may take it before this process runs on
        self.ctl.send(control.Step(
            step=batch.step_id, kind="prefill" if batch.is_prefill else "decode",
            n_real=batch.num_rows, n_tokens=n_tokens, hidden=hidden, forks=forks,
        ))
        # Sampling runs after the forward on the GPU, and its tokens go straight into
        # the ring that the next step's inputs gather from.
        tensors = self._sampling_tensors(batch)
        if on_device:
            # A decode row's input is the token it sampled a step ago, which the host has
            # not collected yet: penalties count it on the device.
            k = batch.num_decode_rows  # the rows whose input can be on the device come first
            tensors.record(self.buffers.input_ids[:k], self._to_device(batch.input_src_step[:k] >= 0))
        if self.while_launching is not None:
            self.while_launching()
        self._await_launched(batch.step_id)
        mark("launched_seen")
        self.logits_ready.wait(self.stream)
        if batch.kv_copies:
            self._copy_blocks(batch.kv_copies)
        logits = self.buffers.logits[:batch.num_logit_rows]
        if batch.selects_rows:
            logits = logits.index_select(0, self._to_device(torch.tensor(batch.sample_rows, dtype=torch.int64)))
        n_rows = logits.shape[0]
        out = self.ring[batch.step_id % RING_STEPS, :n_rows]
        with_logprobs = any(seq.params.logprobs for seq in batch.sampled_seqs)
        if batch.is_verify:
            _, logprobs = sample_verify_rows(self.sampler, logits, tensors, batch.seqs, batch.drafts,
                                             batch.draft_distributions, out, with_logprobs, self._allowed(batch))
        else:
            _, logprobs = self.sampler.sample(logits, tensors, out, with_logprobs=with_logprobs,
                                              allowed=self._allowed(batch))
        host = torch.empty(n_rows, dtype=torch.int64, pin_memory=self.cuda)
        host_logprobs = None if logprobs is None else Logprobs.empty_like(logprobs, pin_memory=self.cuda)
        done = None
        if self.cuda:
            # The copy to the host runs on its own stream, so that the next step's
            # input writes do not queue behind it on the way to the next forward.
            sampled = torch.cuda.Event()
            sampled.record(self.stream)
            self.copy_stream.wait_event(sampled)
            with torch.cuda.stream(self.copy_stream):
                host.copy_(out, non_blocking=True)
                if logprobs is not None:
                    logprobs.to(host_logprobs)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
        else:
            host.copy_(out)
            if logprobs is not None:
                logprobs.to(host_logprobs)
        mark("sampling_enqueued")
        # Rare (a request that asks for its prompt's logprobs): computed and brought to
        # the host now, before the next step overwrites the logits.
        prompt = compute_prompt_logprobs(self.buffers.logits[:batch.num_logit_rows], batch) if batch.prompt_rows else []
        return InflightStep(batch, host, done, host_logprobs, prompt)

    def _allowed(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The rows' allowed-token bitmask on the device, when a row is constrained."""
        seqs = batch.sampled_seqs
        if not any(seq.grammar is not None for seq in seqs):
            return None
        if self.settle is not None:
            self.settle()
        mark("masks_begin")
        mask = self.token_masks.fill_verify(seqs, batch.drafts) if batch.is_verify else self.token_masks.fill(seqs)
        mark("masks_filled")
        return None if mask is None else self._to_device(mask)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Fill forked sequences' blocks from the prompt's, in every layer (one copy each way)."""
        if self.kv_cache is None:
            raise RuntimeError("forking sequences needs the KV arena")
        self.kv_cache.copy_blocks(copies)

    def _gather_inputs(self, batch: ScheduledBatch, n_tokens: int) -> None:
        """Input tokens still on the device come from the ring of sampled tokens."""
        ids = self.buffers.input_ids[:n_tokens]
        src_step, src_row = batch.input_src_step, batch.input_src_row
        first = int(src_step[0])
        if first >= 0 and bool((src_step == first).all()) and torch.equal(src_row, torch.arange(n_tokens)):
            # Steady decode: row i continues row i of one earlier step, one copy.
            ids.copy_(self.ring[first % RING_STEPS, :n_tokens])
            return
        src_step, src_row = self._to_device(src_step), self._to_device(src_row)
        gathered = self.ring[src_step.clamp(min=0) % RING_STEPS, src_row.clamp(min=0)]
        ids.copy_(torch.where(src_step >= 0, gathered, ids))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return to_device(tensor, self.device)

    def _sampling_tensors(self, batch: ScheduledBatch) -> SamplingTensors:
        rows = batch.num_rows if batch.drafts is not None else len(batch.sampled_seqs)
        return self.sampling_tensors.get([s.params for s in batch.sampled_seqs], rows,
                                         lambda: batch.sampling_tensors(self.vocab_size))

    def exchange_draft(self, message: control.Draft) -> control.Drafted:
        """Ask the graph generator, which runs the draft model, for drafts; its answer
        (`hybridd.engine.speculation.graph_drafter`). Every step launched before has
        been answered, so the answer is the next message but for `Stats`."""
        self.ctl.send(message)
        reply = self._await(control.Drafted, message.draft, f"draft {message.draft}")
        assert isinstance(reply, control.Drafted)
        return reply

    def _await_launched(self, step_id: int) -> control.Launched:
        reply = self._await(control.Launched, step_id, f"step {step_id}")
        assert isinstance(reply, control.Launched)
        return reply

    def _await(self, kind: type, number: int, what: str) -> control.Launched | control.Drafted:
        """The graph generator's answer of `kind` numbered `number` (`step` or `draft`),
        handing other messages to `on_control` meanwhile."""
        deadline = time.monotonic() + self.launch_timeout_s
        while True:
            message = self.ctl.recv(timeout_ms=100)
            if message is None:
                if not self.peer_alive() or time.monotonic() > deadline:
                    raise EngineDeadError(f"graph generator did not answer {what}")
                if self.while_waiting is not None:
                    self.while_waiting()
                continue
            if isinstance(message, kind):
                got = message.step if isinstance(message, control.Launched) else message.draft
                if got != number:
                    raise EngineDeadError(f"graph generator answered {got}, expected {what}")
                return message
            self.on_control(message)

    @staticmethod
    def landed(step: InflightStep) -> bool:
        """True when the step's tokens are on the host (collect will not wait)."""
        return step.done is None or step.done.query()

    def collect(self, step: InflightStep) -> list[int]:
        """The step's sampled tokens on the host (waits only for this step's own copy);
        their logprobs, when computed, are then in `step.host_logprobs`."""
        if step.done is not None:
            step.done.synchronize()
        return step.host_tokens.tolist()
