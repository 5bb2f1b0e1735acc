"""The context-generator process: a shell around the engine core.

The core (`hybridd.engine.core.EngineCore`) schedules, runs the overlapped step
pipeline to the graph generator (its peer over a PAIR control channel and the shared
arenas), samples, detokenizes and checks stop criteria. This shell starts the process
(the tokenizer, the sampler, the graph generator's handshake, the core and its parts),
runs the serving loop and wires the parts that face the clients and the supervisor:
the client sockets and the reading of their messages (`client_messages`), admission
(`admission`, with the intake's thread, `intake`), replies (`replies`), the status
report (`status_report`); cancel, timeouts and drain end requests through them.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import zmq

from hybridd.config import Config, resolve_device
from hybridd.engine.block_manager import BlockManager
from hybridd.engine.core import EngineCore
from hybridd.engine.grammar import GrammarCompiler
from hybridd.engine.sampler import Sampler
from hybridd.engine.scheduler import Scheduler
from hybridd.engine.speculation.graph_drafter import GraphDrafter
from hybridd.engine.speculation.policy import SpeculationPolicy
from hybridd.engine.speculation.registry import make_drafter
from hybridd.engine.speculation.speculator import Speculator
from hybridd.model.kv_cache import KVCache
from hybridd.engine.step_pipeline import StepPipeline
from hybridd.errors import EngineDeadError
from hybridd.log import configure, get_logger
from hybridd.model import ModelConfig, load_tokenizer
from hybridd.model.config import chat_stop_strings
from hybridd.runtime.step_buffers import StepBuffers, geometry
from hybridd.serving_metrics import ServingMetrics
from hybridd.runtime.step_trace import StepTracer, mark
from hybridd.ipc.channel import Channel
from hybridd.ipc.posix_shm import pid_alive
from hybridd.ipc.shared_arena import SharedArena
from hybridd.protocol import codec, control
from hybridd.protocol.errors import ErrorCode
from hybridd.protocol.supervisor import Drain, SupervisorInfo
from hybridd.workers.admission import Admission
from hybridd.workers.client_messages import ClientSockets
from hybridd.workers.intake import Intake
from hybridd.workers.loop_exit import LoopExit, Terminated, stop_signals_from
from hybridd.workers.replies import Replies
from hybridd.workers.reply_rings import ReplyRings
from hybridd.workers.request_endings import RequestEndings
from hybridd.workers.status_report import StatusReport
from hybridd.workers.supervisor_link import SupervisorLink
from hybridd.workers.worker_life import start_and_serve

PIPELINE_DEPTH = 2  # steps in flight: the host schedules one step ahead of the GPU
READY_TIMEOUT_S = 3600.0
# How soon the loop comes back to a session's outbox while nothing else is due.
OUTBOX_RETRY_MS = 5


class ContextGenerator:
    def __init__(self, config: Config, ctl_endpoint: str, supervised: bool = True):
        self.config = config
        self.supervised = supervised  # False only for a pair started without a supervisor (tests)
        self.log = get_logger("context_generator", pid=os.getpid())
        self.link = SupervisorLink(config.supervisor_endpoint, "context", config.heartbeat_interval_s)
        self.ctl = Channel(zmq.PAIR, decoder=codec.CONTROL, name="ctl-context")
        self.ctl.bind(ctl_endpoint)
        self.device = resolve_device(config)
        self.tracer = StepTracer("context")
        # The end of the graph generator's poll window after the last `Expect` (0: none open).
        self._expect_until = 0.0
        self.state = "loading"
        self.drain_deadline: float | None = None
        self.started = time.time()
        self.metrics = ServingMetrics()
        self.rings = ReplyRings(config.max_reply_rings)
        # The parts that face the clients, made once the core is (`start`).
        self.replies: Replies | None = None
        self.admission: Admission | None = None
        self.endings: RequestEndings | None = None
        self.client_sockets: ClientSockets | None = None
        self.report: StatusReport | None = None
        self.stop = False
        self.loop_exit = LoopExit(self.log)

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        config = self.config
        if self.device.type == "cuda":
            # A phase of its own: this process's CUDA context is created here, beside the
            # graph generator's weight loading.
            self.link.phase("loading", "initialising CUDA")
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)
        self.link.phase("loading", "loading tokenizer")
        self.tokenizer = load_tokenizer(config.model)
        self.chat_stops = chat_stop_strings(config.model)
        # The fused sampling kernels run on the GPU only; the CPU samples eagerly. Their
        # compilation runs while the graph generator loads its weights and captures its
        # graphs: it needs only the vocabulary's size, and the graph generator's Ready
        # waits in the socket meanwhile.
        vocab_size = ModelConfig.from_dir(config.model).vocab_size
        sampler = Sampler(compile=config.compile_sampler and self.device.type == "cuda")
        self._warm_up_sampler(sampler, vocab_size)
        self.link.phase("loading", "waiting for the graph generator")
        ready = self._await_ready()
        if ready.vocab_size != vocab_size:
            raise EngineDeadError(f"the graph generator's vocabulary has {ready.vocab_size} tokens, "
                                  f"the model's config.json {vocab_size}")
        self.ready = ready
        self.kv_arena = SharedArena.open(ready.arenas["kv"])
        self.step_arena = SharedArena.open(ready.arenas["step"])
        # A draft model runs in the graph generator, beside the model: its draft distributions' region.
        self.draft_arena = SharedArena.open(ready.arenas["draft"]) if "draft" in ready.arenas else None
        self.ctl.send(control.ReadyAck())
        max_tokens, blocks_per_seq = geometry(config.max_prefill_tokens, ready.max_batch, ready.max_model_len,
                                              ready.block_size)
        self.buffers = StepBuffers(dict(self.step_arena.tensors), max_tokens, blocks_per_seq)
        self.block_manager = BlockManager(ready.num_kv_blocks, ready.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.intake = Intake(self.tokenizer, ready.max_model_len)
        self.pipeline = StepPipeline(
            ready, self.buffers, self.ctl, sampler, self.device,
            on_control=self._on_control, peer_alive=self._graph_alive,
            kv_cache=KVCache(self.kv_arena["kv_cache"], ready.block_size, self.kv_arena.tensors.get("kv_scales")),
            while_launching=self._while_launching,
            while_waiting=self.link.heartbeat, settle=self._settle,
        )
        drafter = make_drafter(config.speculative_drafter, config.speculative_ngram_min, config.speculative_ngram_max,
                               self.pipeline.exchange_draft, self.ctl.send,
                               None if self.draft_arena is None else self.draft_arena.tensors["probabilities"])
        k = config.num_speculative_tokens
        self.speculator = None if drafter is None else Speculator(
            drafter, k, SpeculationPolicy(k, adaptive=config.speculative_adaptive))
        self.scheduler = Scheduler(
            self.block_manager,
            speculator=self.speculator,
            # A verify step's rows replay the decode graphs, the largest of which has max_batch rows.
            max_verify_rows=ready.max_batch,
            max_batch=ready.max_batch,
            max_prefill_tokens=config.max_prefill_tokens,
            chunk_tokens=config.chunk_tokens,
            max_model_len=ready.max_model_len,
            block_table_width=self.buffers.max_blocks_per_seq,
            max_prefill_seqs=ready.max_prefill_seqs,
            eos_token_ids=ready.eos_token_ids,
            tokenizer=self.tokenizer,
        )
        if isinstance(drafter, GraphDrafter) and drafter.hidden_states_kept:  # an EAGLE-3 head's
            self.pipeline.feed_hidden_states(drafter)
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size, ready.eos_token_ids,
                                        timeout_s=config.structured_compile_timeout_s,
                                        cache_size=config.structured_cache_size)
        self.core = EngineCore(self.scheduler, self.pipeline, self.tokenizer, PIPELINE_DEPTH,
                               on_launch=self._launched)
        self.replies = Replies(self.core, self.rings, self.metrics, self.log)
        self._deliver = self.replies.deliver  # bound once: the loop and the pipeline's hooks call it every step
        self.admission = Admission(config, ready, self.core, self.replies, self.intake, self.grammars, self.tokenizer,
                                   self.chat_stops, state=lambda: self.state, expect_step=self._expect_step)
        self.endings = RequestEndings(self.core, self.admission, self.replies)
        self.report = StatusReport(config, self.device, ready, self.core, self.speculator, self.intake, self.admission,
                                   self.replies, rejected=lambda: self.client_sockets.rejected(),
                                   started=self.started, supervised=self.supervised, state=lambda: self.state)
        self.client_sockets = ClientSockets(self.intake, self.admission, self.endings, self.report, self.replies)
        self.client_sockets.bind(config)
        self.client, self.tcp = self.client_sockets.client, self.client_sockets.tcp
        self.state = "ready"
        self.link.phase("ready", "serving")
        self.log.info("serving", endpoint=config.client_endpoint, kv_blocks=ready.num_kv_blocks)

    def _warm_up_sampler(self, sampler: Sampler, vocab_size: int) -> None:
        """Compile every sampling path before ready, so no request pays for it and the
        serving loop never stalls on a compilation; heartbeats go out in between."""
        if not sampler.compiled:
            return

        def progress(done: int, total: int) -> None:
            self.link.phase("loading", "compiling the sampler", done, total)
            self.link.heartbeat(force=True)

        sampler.warm_up(vocab_size, self.device, progress)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _await_ready(self) -> control.Ready:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.link.heartbeat()
            message = self.ctl.recv(timeout_ms=int(self.config.heartbeat_interval_s * 1000))
            if message is None:
                continue
            if isinstance(message, control.Ready):
                return message
        raise EngineDeadError("graph generator never became ready")

    def _graph_alive(self) -> bool:
        return self.ready.pid <= 0 or pid_alive(self.ready.pid)

    def _on_control(self, message: control.ControlMessage) -> None:
        if isinstance(message, control.Stats):
            self.report.graph_stats = message.stats

    # ------------------------------------------------------------------- loop
    def serve(self) -> None:
        self.pipeline.serve_from_this_thread()
        poller = zmq.Poller()
        sockets = [self.client.socket, self.link.socket, self.ctl.socket] + ([self.tcp.socket] if self.tcp else [])
        sockets += [sessions.monitor for sessions in self.replies.sessions.values()]
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self.intake.fileno(), zmq.POLLIN)
        last_alive_check = 0.0
        idle_ms = int(self.config.heartbeat_interval_s * 1000)
        poll_until = 0.0  # busy_poll_s after the last piece of work
        while not self.stop:
            self.link.heartbeat()
            busy = self.core.has_work
            if busy:
                poll_until = time.monotonic() + self.config.busy_poll_s
            elif poll_until and time.monotonic() < poll_until:
                busy = True
            outboxes = self.replies.pending
            events = dict(poller.poll(timeout=0 if busy else OUTBOX_RETRY_MS if outboxes else idle_ms))
            if self.link.socket in events:
                self._supervisor_commands()
            for channel in (self.client, self.tcp):
                if channel is not None and channel.socket in events:
                    self.client_sockets.read(channel)
            if self.intake.fileno() in events:
                self.admission.encoded_prompts()
            for identity in self.replies.serve_sessions():  # a disconnect, an over-size frame, a peer that died
                self.endings.end_session(identity)
            if self.ctl.socket in events and not self.core.inflight:
                while (message := self.ctl.recv(timeout_ms=0)) is not None:
                    self._on_control(message)
            now = time.monotonic()
            if now - last_alive_check > 0.1:
                last_alive_check = now
                if not self._graph_alive():
                    raise EngineDeadError("graph generator died")
                self.endings.expire(now)
            self._deliver(self.core.step())
            if self.state == "draining" and self.endings.drained(self.drain_deadline):
                self.loop_exit.commanded("drain")
                self.stop = True
            self.rings.end_batch()

    def _launched(self) -> None:
        self._expect_until = 0.0  # a step ends the graph generator's poll window
        self.tracer.step()
        self.link.steps += 1

    def _while_launching(self) -> None:
        """While the graph generator launches a step: the steps that have landed are
        retired and their tokens sent now, not after the launch."""
        self.core.retire_landed()
        self._deliver(self.core.take_outputs())

    def _settle(self) -> None:
        """A constrained batch's forward runs: every step before it is retired (its tokens
        advance the grammars its masks are filled from) and its tokens sent."""
        self.core.retire_all()
        self._deliver(self.core.take_outputs())

    def _expect_step(self) -> None:
        """Tell the graph generator that a step follows, when none is in flight: it polls
        for the step instead of sleeping, and the wake-up of its threads overlaps this
        request's admission instead of following it (at most once per poll window)."""
        window = self.config.step_wake_poll_s
        if not window or self.core.inflight:
            return
        now = time.monotonic()
        if now >= self._expect_until:
            self._expect_until = now + window
            mark("expect_send")
            self.ctl.send(control.Expect())

    # ------------------------------------------------------------ supervisor
    def _supervisor_commands(self) -> None:
        while (command := self.link.poll_command()) is not None:
            if isinstance(command, Drain):
                self._begin_drain(command.timeout_s)
            elif isinstance(command, SupervisorInfo):
                self.report.supervisor_info = command.info.to_wire()

    def _begin_drain(self, timeout_s: float) -> None:
        if self.state != "ready":
            return
        self.state = "draining"
        self.drain_deadline = time.monotonic() + timeout_s
        in_flight = len(self.replies.requests)
        self.link.phase("draining", f"draining {in_flight} requests")
        self.log.info("draining", requests=in_flight, timeout_s=timeout_s)

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """A terminal error for every request still in flight (engine death, shutdown)."""
        if self.endings is not None:
            self.endings.fail_all(code, message)

    def close(self) -> None:
        try:
            self.ctl.send(control.Shutdown())
        except Exception:  # the peer may be gone already
            pass
        for name in ("kv_arena", "step_arena", "draft_arena", "intake", "grammars"):
            if getattr(self, name, None) is not None:
                getattr(self, name).close()
        self.link.phase("stopped")
        if self.replies is not None:
            self.replies.close()
        self.rings.close()
        if self.client_sockets is not None:
            self.client_sockets.close()
        self.ctl.close(linger_ms=200)
        self.link.close()


def main(config: dict[str, Any], ctl_endpoint: str, supervised: bool = True) -> None:
    cfg = Config.from_dict(config)
    configure(cfg.log_level, json=cfg.log_format == "json")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor drains us with a message

    def terminate(signum, frame):
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, terminate)
    if supervised:
        stop_signals_from(os.getppid(), get_logger("context_generator", pid=os.getpid()))
    worker = ContextGenerator(cfg, ctl_endpoint, supervised)
    try:
        start_and_serve(worker)
    except EngineDeadError as exc:
        worker.log.error("engine_dead", error=exc.message)
        worker.fail_all(ErrorCode.ENGINE_DEAD, f"the engine died: {exc.message}")
        raise SystemExit(3) from exc
    except SystemExit:
        worker.fail_all(ErrorCode.ENGINE_DEAD, "the engine is shutting down")
        raise
    except Exception as exc:
        # Any other failure ends the process too (the supervisor classifies it); every
        # client still hears about it first.
        worker.fail_all(ErrorCode.ENGINE_DEAD, f"the engine died: {type(exc).__name__}: {exc}")
        raise
    finally:
        # On the way out already (a dead engine, a drain): a SIGTERM now, the supervisor's
        # for the same failure, would raise Terminated inside close() or an atexit callback.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        worker.close()
