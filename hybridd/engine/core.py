"""The engine core: one object whose `step()` admits, schedules, runs one step through
a runner and retires what landed, returning what happened as data.

It owns the requests' sequences, the scheduler (with its KV block manager), the
steps in flight and the per-token bookkeeping (first-token and inter-token times,
logprob texts, throughput). It owns no socket and no process: the context-generator
process is a shell around it (intake, replies, sessions, status), and the in-process
path (`hybridd.engine.generate`) drives the same core over the model in its own
process. A runner launches a scheduled batch and hands its sampled tokens back
(`StepRunner`); the daemon's runner is the step pipeline to the graph generator.

Steps are pipelined `pipeline_depth` deep: the next step is launched before the one
before it is retired, so the host schedules one step ahead of the device (a decode
row whose input token is still on the device names the step that sampled it). A
retired step's outputs are kept until the caller takes them: `step()` returns them,
and a shell that must send tokens sooner (while the next step is being launched) takes
them with `take_outputs()` from the runner's `while_launching` hook.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hybridd.engine.grammar import CompiledGrammar
from hybridd.engine.prompt_logprobs import PromptLogprobRows
from hybridd.engine.sampler import Logprobs
from hybridd.engine.scheduler import AdmissionError, ScheduledBatch, Scheduler
from hybridd.engine.sequence import Sequence
from hybridd.engine.step_pipeline import InflightStep
from hybridd.engine.throughput import Throughput
from hybridd.protocol.limits import MAX_FINAL_LOGPROB_ENTRIES
from hybridd.protocol.messages import PromptLogprob, SamplingParams, TokenLogprob, TopLogprob
from hybridd.runtime.step_trace import mark


class StepRunner(Protocol):
    """Runs scheduled batches: launch one, tell whether its tokens are on the host, collect them."""

    def launch(self, batch: ScheduledBatch) -> InflightStep: ...

    def landed(self, step: InflightStep) -> bool: ...

    def collect(self, step: InflightStep) -> list[int]: ...


@dataclass
class EngineRequest:
    """A request the core runs: its sequences (index 0 is the one queued; the others are
    forked from it at its prefill) and its deadline (time.monotonic(), None: none)."""

    id: str
    seqs: list[Sequence]
    deadline: float | None = None

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def arrival(self) -> float:
        return self.seqs[0].arrival_time

    @property
    def completion_tokens(self) -> int:
        return sum(seq.num_output_tokens for seq in self.seqs)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV the prefix cache held when the request was admitted."""
        return self.seqs[0].num_cached_tokens


@dataclass
class TokenOutput:
    """One new token of one sequence, with its text so far released by the stop criteria."""

    request: EngineRequest
    seq: Sequence
    token: int
    text: str
    logprob: TokenLogprob | None


@dataclass
class EngineOutputs:
    """What happened since the outputs were last taken: new tokens in order, requests
    whose every sequence ended (each once), and the latencies to record (seconds): a
    step's time is from its launch, or the landing of the step before it when that came
    later, to the landing of its tokens."""

    tokens: list[TokenOutput] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    queued_s: list[float] = field(default_factory=list)
    prefill_step_s: list[float] = field(default_factory=list)  # steps that carried prompt tokens
    decode_step_s: list[float] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished or self.first_token_s or self.queued_s or self.prefill_step_s
                    or self.decode_step_s)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: StepRunner, tokenizer=None, pipeline_depth: int = 2,
                 on_launch: Callable[[], None] | None = None) -> None:
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer  # for the texts of logprob entries; None: no texts
        self.pipeline_depth = pipeline_depth
        self.on_launch = on_launch  # called after each launch (the shell counts steps, ends poll windows)
        self.requests: dict[str, EngineRequest] = {}
        self.inflight: deque[InflightStep] = deque()
        self._launched_at: deque[float] = deque()  # each step in flight's launch time
        self._landed_at = 0.0  # when the last retired step's tokens were taken
        self.throughput = Throughput()
        self.steps = 0
        self._owners: dict[str, EngineRequest] = {}  # a sequence's id -> its request
        self._token_texts: dict[int, str] = {}
        self._outputs = EngineOutputs()

    # ---------------------------------------------------------------- requests
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float | None = None,
            deadline: float | None = None, cache_salt: str | None = None,
            grammar: CompiledGrammar | None = None, speculative: bool = True) -> EngineRequest:
        """Queue a request of `params.n` sequences (sharing prefix-cache blocks only with
        requests of the same `cache_salt`; each following a copy of `grammar`, its
        structured output compiled; drafted for when the scheduler speculates, unless
        `speculative` is False); raises `AdmissionError` (naming the field) when it can never run, and
        ValueError when the id is already running."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        if (grammar is None) != (params.structured is None):
            raise ValueError("a request with structured output needs its compiled grammar, and only it")
        top = getattr(params, "prompt_logprobs", None)
        if top is not None:
            entries = len(prompt_ids) * (1 + top)
            if entries > MAX_FINAL_LOGPROB_ENTRIES:
                raise AdmissionError(f"{len(prompt_ids)} prompt tokens x (1 + prompt_logprobs {top}) = {entries} "
                                     f"logprob entries exceed the {MAX_FINAL_LOGPROB_ENTRIES} one final reply "
                                     f"carries; ask for fewer alternatives or a shorter prompt",
                                     "sampling.prompt_logprobs")
            # Every prompt token's logits are needed: no cached prefix may stand in for them.
            cache_salt = f"prompt logprobs of {request_id} {time.monotonic_ns()}"
        arrival = time.monotonic() if arrival is None else arrival
        seqs = [Sequence(request_id if i == 0 else f"{request_id}#{i}", prompt_ids, params, arrival, index=i,
                         cache_salt=cache_salt, speculative=speculative)
                for i in range(params.n)]
        if grammar is not None:
            for seq in seqs:
                seq.grammar = grammar.new_matcher()
        seqs[0].forks = seqs[1:]
        self.scheduler.add(seqs[0])
        request = EngineRequest(request_id, seqs, deadline)
        self.requests[request_id] = request
        for seq in seqs:
            self._owners[seq.request_id] = request
        return request

    def abort(self, request_id: str, reason: str = "cancelled") -> EngineRequest | None:
        """End every unfinished sequence of a request for `reason` (cancelled, timeout);
        it then appears among the finished outputs. None when it is not running."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            self.scheduler.abort(seq.request_id, reason)
        self._end_if_finished(request)
        return request

    def expire(self, now: float) -> None:
        """End the requests whose deadline has passed, with reason `timeout`."""
        for request in [r for r in self.requests.values() if r.deadline is not None and now > r.deadline]:
            self.abort(request.id, "timeout")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.inflight)

    # -------------------------------------------------------------------- step
    def step(self) -> EngineOutputs:
        """Launch the next step while fewer than `pipeline_depth` are in flight (the steps
        that have landed by then are retired during the launch); retire the oldest when
        the pipeline is full or nothing new can start, unless its tokens are not on the
        host yet and nothing new started (the caller then serves its sockets and comes
        back). Returns the outputs not taken yet."""
        if len(self.inflight) < self.pipeline_depth:
            batch = self.scheduler.schedule()
            if batch is not None:
                self._launch(batch)
                if len(self.inflight) < self.pipeline_depth:
                    return self.take_outputs()
            elif self.inflight and not self.runner.landed(self.inflight[0]):
                return self.take_outputs()
        if self.inflight:
            self._retire(self.inflight.popleft())
        return self.take_outputs()

    def retire_all(self) -> None:
        """Retire every step in flight, waiting for its tokens (a constrained batch's masks
        need its sequences' last tokens: the runner calls this once its forward runs)."""
        while self.inflight:
            self._retire(self.inflight.popleft())

    def retire_landed(self) -> None:
        """Retire the steps in flight whose tokens are on the host already (the runner
        calls this while it launches the next step, so a token is known then, not after)."""
        while self.inflight and self.runner.landed(self.inflight[0]):
            self._retire(self.inflight.popleft())

    def take_outputs(self) -> EngineOutputs:
        """The outputs since the last take, to be read before the next call into the core.
        An empty one stays the one being filled: the loop takes outputs several times a
        step, mostly empty, and makes a new one only when it hands out a full one."""
        outputs = self._outputs
        if outputs:
            self._outputs = EngineOutputs()
        return outputs

    def drain(self) -> None:
        """Wait for every step in flight and drop its tokens (shutting down)."""
        while self.inflight:
            self.runner.collect(self.inflight.popleft())
            self._launched_at.popleft()

    def _launch(self, batch: ScheduledBatch) -> None:
        mark("scheduled")
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.scheduled_time is None:
                seq.scheduled_time = now
                if seq.index == 0 and seq.request_id in self._owners:
                    self._outputs.queued_s.append(now - seq.arrival_time)
        self.inflight.append(self.runner.launch(batch))
        # The step is sent: the blocks it offered the prefix cache are keyed while it runs.
        self.scheduler.block_manager.register_deferred()
        self._launched_at.append(now)
        self.steps += 1
        if self.on_launch is not None:
            self.on_launch()

    def _retire(self, step: InflightStep) -> None:
        tokens = self.runner.collect(step)
        landed = time.monotonic()
        started = max(self._launched_at.popleft(), self._landed_at)
        self._landed_at = landed
        if step.batch.is_prefill:
            self._outputs.prefill_step_s.append(landed - started)
        else:
            self._outputs.decode_step_s.append(landed - started)
        seqs = step.batch.sampled_seqs
        if any(seq.request_id in self._owners for seq in seqs):
            # A step launched before its sequences finished lands after their final reply:
            # its tokens are dropped, and its mark would fall in the next request's path.
            mark("tokens_on_host")
        before = [(seq.num_output_tokens, seq.last_token_time) for seq in seqs]
        if step.batch.is_verify:
            finished, appended = self.scheduler.postprocess_verify(step.batch, tokens)
        else:
            finished = self.scheduler.postprocess(step.batch, tokens)
            # A sequence that finished a step earlier had one more token sampled; it is dropped.
            appended = [[(token, seq.new_text, row)] if seq.num_output_tokens > count else []
                        for row, (seq, token, (count, _)) in enumerate(zip(seqs, tokens, before, strict=True))]
        outputs = self._outputs
        new = 0
        for seq, entries, (count, previous) in zip(seqs, appended, before, strict=True):
            request = self._owners.get(seq.request_id)
            if request is None or not entries:
                continue
            new += len(entries)
            if count == 0 and seq.index == 0:  # the request's first token
                outputs.first_token_s.append(seq.first_token_time - seq.arrival_time)
            if previous is not None:
                outputs.inter_token_s.append(seq.last_token_time - previous)
            # A verify step's further tokens come with its first: no time between them.
            outputs.inter_token_s.extend([0.0] * (len(entries) - 1))
            for token, text, row in entries:
                logprob = None
                if seq.logprobs is not None:
                    logprob = self._token_logprob(step.host_logprobs, row, token, seq.params.top_logprobs)
                    seq.logprobs.append(logprob)
                outputs.tokens.append(TokenOutput(request, seq, token, text, logprob))
        self.throughput.add(new)
        self.scheduler.observe_step(step.batch, landed - started, new)
        for rows in step.prompt_logprobs:
            self._record_prompt_logprobs(rows)
        for seq in finished:
            request = self._owners.get(seq.request_id)
            if request is not None:
                self._end_if_finished(request)

    def _end_if_finished(self, request: EngineRequest) -> None:
        if request.finished and self.requests.pop(request.id, None) is not None:
            for seq in request.seqs:
                self._owners.pop(seq.request_id, None)
            self._outputs.finished.append(request)

    # ---------------------------------------------------------------- logprobs
    def _token_logprob(self, logprobs: Logprobs, row: int, token: int, top: int) -> TokenLogprob:
        """The host's view of one row's logprobs: the sampled token's and its top
        alternatives (those the sampled distribution gives any mass), with their texts."""
        alternatives = []
        if top:
            values = logprobs.top_values[row, :top].tolist()
            ids = logprobs.top_ids[row, :top].tolist()
            alternatives = [TopLogprob(token_id=i, text=self._token_text(i), logprob=v)
                            for i, v in zip(ids, values, strict=True) if v != float("-inf")]
        return TokenLogprob(token_id=token, text=self._token_text(token),
                            logprob=float(logprobs.sampled[row]), top_logprobs=alternatives)

    def _record_prompt_logprobs(self, rows: PromptLogprobRows) -> None:
        """A chunk's prompt logprobs, in the sequence's order (a position once)."""
        recorded = rows.seq.prompt_logprobs
        if recorded is None:
            return
        for i, token in enumerate(rows.token_ids):
            if rows.first_position + i != len(recorded):
                continue
            alternatives = [TopLogprob(token_id=t, text=self._token_text(t), logprob=v)
                            for t, v in zip(rows.top_ids[i], rows.top_values[i], strict=True)]
            recorded.append(PromptLogprob(token_id=token, text=self._token_text(token), logprob=rows.logprobs[i],
                                          rank=rows.ranks[i], top_logprobs=alternatives))

    def _token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text
