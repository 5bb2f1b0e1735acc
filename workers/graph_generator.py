"""The graph-generator process: the static domain.

It loads the model, allocates the shared arenas (the KV cache, the step buffers with
the logits) and the interprocess events, captures the decode graphs, hands the
manifest to the context generator, then serves `Step` messages: wait for the
context generator's `inputs_ready`, replay the step's graph (or run it eagerly),
record `logits_ready`, reply `Launched` as soon as the work is enqueued. Prefill
graphs are captured by the runner's background thread after ready.

With a draft model (speculative_drafter draft_model) it also loads the draft, its KV
arena and step buffers, and captures its graphs the same way (`DraftRunner`, under a
share of the graph memory budget); it answers `Draft` messages with `Drafted`, the
draft distributions in the shared `draft` arena. With an EAGLE-3 head (speculative_drafter
eagle3) the same, the head on the model's device and in its dtype (`eagle3_runner`),
and after each step's forward the rows of the model's hidden states its `Step` names
go to the head.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import zmq

from hybridd import environment
from hybridd.config import (
    Config, draft_model_dir, eagle3_head_dir, resolve_device, resolve_dtype, resolve_kv_cache_dtype,
)
from hybridd.engine.speculation.draft_runner import DraftServer, draft_model_runner
from hybridd.engine.speculation.eagle3_runner import HeadGeometry, eagle3_runner
from hybridd.log import configure, get_logger
from hybridd.kernels.choices import KernelChoices
from hybridd.model import KVCache, ModelConfig, ModelLoadError, load_model
from hybridd.model.kv_cache import blocks_for, is_fp8, kv_arena_shape, kv_bytes_per_block, kv_scales_shape
from hybridd.model.eagle3 import Eagle3Head, load_eagle3_head
from hybridd.model.llama import LlamaModel
from hybridd.runtime.buckets import BucketPlan
from hybridd.runtime.graph_memory import activation_bytes, batch_bytes
from hybridd.runtime.graph_runner import GraphRunner
from hybridd.runtime.kernel_precompile import CompilePool
from hybridd.runtime.step_buffers import StepBuffers, buffer_layout, geometry
from hybridd.runtime.step_trace import StepTracer, mark
from hybridd.ipc.arena_layout import ArenaLayout
from hybridd.ipc.channel import Channel
from hybridd.ipc.events import InterprocessEvent
from hybridd.ipc.shared_arena import SharedArena
from hybridd.protocol import codec, control
from hybridd.protocol.errors import ProtocolError
from hybridd.workers.loop_exit import LoopExit
from hybridd.workers.supervisor_link import SupervisorLink
from hybridd.workers.worker_life import start_and_serve

CPU_DEFAULT_KV_BLOCKS = 512
# Test hook (README, Troubleshooting): seconds to stall in the weight load, in the
# loading thread itself, to show that a slow load is not taken for a hang.
SLOW_LOAD_HOOK = "HYBRIDD_TEST_SLOW_LOAD_S"
FREE_MEMORY_HOOK = "HYBRIDD_TEST_FREE_MEMORY_BYTES"
STATS_INTERVAL_S = 1.0
# The draft model's KV cache holds a full batch of the longest sequences, within this many tokens.
MAX_DRAFT_KV_TOKENS = 1 << 16


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class GraphGenerator:
    def __init__(self, config: Config, ctl_endpoint: str):
        self.config = config
        self.log = get_logger("graph_generator", pid=os.getpid())
        self.link = SupervisorLink(config.supervisor_endpoint, "graph", config.heartbeat_interval_s)
        self.ctl = Channel(zmq.PAIR, decoder=codec.CONTROL, name="ctl-graph")
        self.ctl.connect(ctl_endpoint)
        self.device = resolve_device(config)
        self.tracer = StepTracer("graph")
        self._stop = False
        self.loop_exit = LoopExit(self.log)

    def start(self) -> None:
        """Load the model, compile and capture; Ready to the context generator."""
        pool = self._start_compile_pool()
        try:
            self._load_and_capture(pool)
        finally:
            if pool is not None:
                pool.close()

    def _start_compile_pool(self) -> CompilePool | None:
        """The processes that compile the graphs' kernels (`kernel_compile_workers`, at most
        one per core), started before the weights load so that their imports overlap it."""
        config = self.config
        workers = min(config.kernel_compile_workers, os.cpu_count() or 1)
        if not (config.use_cuda_graphs and self.device.type == "cuda" and workers):
            return None
        try:
            return CompilePool(workers)
        except Exception as exc:  # the warm-ups compile the kernels one after another instead
            self.log.warning("compile_pool_not_started", error=f"{type(exc).__name__}: {exc}")
            return None

    def _load_and_capture(self, pool: CompilePool | None) -> None:
        config = self.config
        self.link.phase("loading", f"loading {config.model}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dtype = resolve_dtype(config, self.device)
        slow_load_s = environment.number(SLOW_LOAD_HOOK)
        if slow_load_s > 0:  # the test hook: a load as slow as a cold disk's
            self.log.warning("loading slowly on purpose", seconds=slow_load_s, hook=SLOW_LOAD_HOOK)
            time.sleep(slow_load_s)
        model_config = ModelConfig.from_dir(config.model)
        max_model_len = min(config.max_model_len or model_config.max_model_len, model_config.max_model_len)
        choices = KernelChoices.from_settings("auto", config.gemm_fusions, config.pdl)
        model = load_model(config.model, dtype=dtype, device=self.device, max_positions=max_model_len,
                           kernels=choices, quantization=config.quantization)
        mc = model.config
        self.model = model
        self.max_model_len = max_model_len
        # Before the KV cache is sized from the memory left: the draft's weights and KV come first.
        draft_model, draft_kv = self._load_draft(dtype, choices, max_model_len)
        head, head_kv = self._load_head(model, max_model_len)
        self.plan = BucketPlan.create(config.decode_buckets, config.prefill_buckets, config.max_prefill_seqs,
                                      mixed_tokens=min(config.chunk_tokens, config.max_prefill_tokens))
        block_size = config.block_size
        kv_dtype = resolve_kv_cache_dtype(config, model.dtype)
        num_blocks = self._num_kv_blocks(model, block_size, kv_dtype)
        self.plan = self._fit_batch(model, num_blocks * kv_bytes_per_block(mc, block_size, kv_dtype))
        max_tokens, blocks_per_seq = geometry(config.max_prefill_tokens, self.plan.max_batch, max_model_len, block_size)
        aux_layers = () if head is None else head.spec.aux_layers  # the hidden states the head reads
        step_layout = buffer_layout(max_tokens, self.plan.max_rows, blocks_per_seq, mc.vocab_size,
                                    (len(aux_layers) * mc.hidden_size, model.dtype) if aux_layers else None)
        kv_shape = kv_arena_shape(mc, num_blocks, block_size)

        kv_layout = {"kv_cache": (kv_shape, _dtype_name(kv_dtype))}
        if is_fp8(kv_dtype):  # fixed buffers beside the values, as the graphs capture them
            kv_layout["kv_scales"] = (kv_scales_shape(mc, num_blocks, block_size), "float32")
        self.kv_arena = SharedArena.create(ArenaLayout(kv_layout), self.device)
        self.step_arena = SharedArena.create(
            ArenaLayout({name: (shape, _dtype_name(dt)) for name, (shape, dt) in step_layout.items()}), self.device
        )
        self.kv_cache = KVCache(self.kv_arena["kv_cache"], block_size, self.kv_arena.tensors.get("kv_scales"))
        self.buffers = StepBuffers(dict(self.step_arena.tensors), max_tokens, blocks_per_seq)
        budget = config.graph_memory_budget_mb << 20
        drafter_config = draft_model.config if draft_model is not None else \
            HeadGeometry.of(head.spec) if head is not None else None
        draft_budget = 0 if drafter_config is None else self._draft_budget(budget, model, drafter_config)
        self.runner = GraphRunner(
            model, self.kv_cache, self.buffers, self.plan,
            use_graphs=config.use_cuda_graphs,
            memory_budget_bytes=budget - draft_budget,
            aux_layers=aux_layers,
        )
        self.draft_arena: SharedArena | None = None
        self.draft: DraftServer | None = None
        if draft_model is not None:
            # A row per draft token of a verify step, whose rows are at most max_batch.
            self.draft_arena = SharedArena.create(
                ArenaLayout({"probabilities": ((self.plan.max_batch, mc.vocab_size), "float32")}), self.device)
            draft_buffers = StepBuffers.allocate(max_tokens, self.plan.max_rows, blocks_per_seq,
                                                 draft_model.config.vocab_size, self.device)
            self.draft = draft_model_runner(draft_model, draft_kv, draft_buffers, self.plan,
                                            self.draft_arena["probabilities"], use_graphs=config.use_cuda_graphs,
                                            memory_budget_bytes=draft_budget, stream=self.runner.stream)
        elif head is not None:
            self.draft = eagle3_runner(head, head_kv, self.plan, max_tokens, use_graphs=config.use_cuda_graphs,
                                       memory_budget_bytes=draft_budget, stream=self.runner.stream)
        self.inputs_ready = InterprocessEvent.create(self.device)
        self.logits_ready = InterprocessEvent.create(self.device)

        if pool is not None:
            self.link.phase("capturing", f"compiling kernels in {pool.workers} processes")
            report = self.runner.precompile_kernels(pool)
            pool.close()  # its processes' memory is not needed past this point
            if report is not None:
                self.link.phase("capturing", f"compiled {report.missing} kernels in {report.workers} processes "
                                f"({report.kernels - report.missing} found compiled, {len(report.failed)} failed)")
        total = len(self.plan.decode)
        self.link.phase("capturing", "capturing decode graphs", 0, total)
        self.runner.capture_decode_graphs(
            progress=lambda done, n: self.link.phase("capturing", "capturing decode graphs", done, n)
        )
        self.link.phase("capturing", "compiling the prefill kernels")
        self.runner.warm_up_prefill()
        if self.draft is not None:
            what = f"capturing the {'draft model' if draft_model is not None else 'EAGLE-3 head'}'s decode graphs"
            self.link.phase("capturing", what, 0, total)
            self.draft.capture(progress=lambda done, n: self.link.phase("capturing", what, done, n))
        arenas = {"kv": self.kv_arena.manifest(), "step": self.step_arena.manifest()}
        if self.draft_arena is not None:
            arenas["draft"] = self.draft_arena.manifest()
        scheme = model.quantization
        quantization = {} if scheme is None else scheme.facts() | {
            "description": scheme.describe(model.kernels.fp8_prefill_per_token)}
        self.ctl.send(control.Ready(
            arenas=arenas,
            events={"inputs_ready": self.inputs_ready.ipc_handle(), "logits_ready": self.logits_ready.ipc_handle()},
            model=config.model,
            vocab_size=mc.vocab_size,
            eos_token_ids=list(mc.eos_token_ids),
            max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            max_batch=self.plan.max_batch,
            decode_buckets=list(self.plan.decode),
            prefill_buckets=list(self.plan.prefill),
            max_prefill_seqs=self.plan.max_prefill_seqs,
            quantization=quantization,
            pid=os.getpid(),
        ))
        self.log.info("ready_sent", kv_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                      kv_cache_dtype=_dtype_name(kv_dtype), quantization=quantization.get("description", "none"))

    def _load_draft(self, dtype: torch.dtype, choices: KernelChoices,
                    max_model_len: int) -> tuple[LlamaModel | None, KVCache | None]:
        """The draft model (speculative_drafter draft_model) on this device, and its KV
        cache: room for a full batch of the longest sequences and their drafts, within
        MAX_DRAFT_KV_TOKENS. A KV cache that does not fit in the memory left beside the
        weights is refused, naming the draft."""
        config = self.config
        if config.speculative_drafter != "draft_model":
            return None, None
        path = draft_model_dir(config)
        self.link.phase("loading", f"loading the draft model {path}")
        draft = load_model(path, dtype=dtype, device=self.device, max_positions=max_model_len, kernels=choices)
        block_size = config.block_size
        tokens = self._drafter_kv_tokens(max_model_len)
        blocks = blocks_for(tokens, block_size)
        need = (blocks + 1) * kv_bytes_per_block(draft.config, block_size, draft.dtype)
        free = self._free_memory_bytes()
        if free is not None and need > free:
            raise ModelLoadError(f"speculative_draft_model {path}: its KV cache of {tokens} tokens needs "
                                 f"{need / 2**30:.2f} GiB, and {max(free, 0) / 2**30:.2f} GiB is left beside "
                                 f"the weights; lower max_batch or max_model_len")
        kv = KVCache.allocate(draft.config, blocks, block_size, draft.dtype, self.device)
        self.log.info("draft_model_loaded", path=path, layers=draft.config.num_layers, kv_tokens=tokens,
                      kv_bytes=need)
        return draft, kv

    def _drafter_kv_tokens(self, max_model_len: int) -> int:
        """The tokens of a drafter's KV cache (a draft model's, an EAGLE-3 head's): a full
        batch of the longest sequences and their drafts, within MAX_DRAFT_KV_TOKENS."""
        config = self.config
        return min(config.max_batch * (max_model_len + config.num_speculative_tokens), MAX_DRAFT_KV_TOKENS)

    def _load_head(self, model: LlamaModel, max_model_len: int) -> tuple[Eagle3Head | None, KVCache | None]:
        """The EAGLE-3 head (speculative_drafter eagle3) on the model's device and in its
        dtype, embedding with the model's embedding where it has none of its own, and its
        KV cache (as a draft model's is sized, `_drafter_kv_tokens`)."""
        config = self.config
        if config.speculative_drafter != "eagle3":
            return None, None
        path = eagle3_head_dir(config)
        self.link.phase("loading", f"loading the EAGLE-3 head {path}")
        head = load_eagle3_head(path, model.config, config.model, model.embed_tokens, max_model_len,
                                dtype=model.dtype, device=self.device)
        tokens = self._drafter_kv_tokens(max_model_len)
        blocks, spec = blocks_for(tokens, config.block_size), head.spec
        need = (blocks + 1) * config.block_size * 2 * spec.num_kv_heads * spec.head_dim * head.dtype.itemsize
        free = self._free_memory_bytes()
        if free is not None and need > free:
            raise ModelLoadError(f"speculative_eagle3_head {path}: its KV cache of {tokens} tokens needs "
                                 f"{need / 2**30:.2f} GiB, and {max(free, 0) / 2**30:.2f} GiB is left beside "
                                 f"the weights; lower max_batch or max_model_len")
        kv = head.allocate_kv(blocks, config.block_size)
        self.log.info("eagle3_head_loaded", path=path, aux_layers=list(head.spec.aux_layers),
                      draft_vocab=head.spec.draft_vocab_size, dtype=_dtype_name(head.dtype), kv_tokens=tokens)
        return head, kv

    def _draft_budget(self, budget: int, model: LlamaModel, drafter: ModelConfig | HeadGeometry) -> int:
        """The drafter's share of the graph memory budget: its part of the model's and its
        activations at the largest prefill bucket."""
        elem = torch.finfo(model.dtype).bits // 8
        tokens, rows = self.plan.max_prefill_tokens, self.plan.max_rows
        ours = activation_bytes(model.config, tokens, rows, elem)
        theirs = activation_bytes(drafter, tokens, rows, elem)  # type: ignore[arg-type]
        return budget * theirs // (ours + theirs)

    def _free_memory_bytes(self) -> int | None:
        """The device's free memory now (the host's available memory on a CPU); None if unknown."""
        hook = environment.number(FREE_MEMORY_HOOK) if environment.get(FREE_MEMORY_HOOK) else None
        if hook is not None:
            return int(hook)
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def _fit_batch(self, model, kv_bytes: int) -> BucketPlan:
        """The bucket plan whose largest batch fits the memory the weights and the KV cache
        leave (its logits rows and its decode step's activations): a max_batch that cannot
        fit is lowered to the largest decode bucket that does, with a warning that says
        so; one where not even a batch of 1 fits is refused (no restart can fix it)."""
        plan, free = self.plan, self._free_memory_bytes()
        if free is None:
            return plan
        left = free - kv_bytes
        if left <= 0:
            return plan  # the KV cache cannot fit either: its allocation says so, naming it
        elem = torch.finfo(model.dtype).bits // 8
        need = {b: batch_bytes(model.config, b, plan.max_prefill_seqs, elem) for b in plan.decode}
        fitting = [b for b in plan.decode if need[b] <= left]
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        if not fitting:
            raise ModelLoadError(f"max_batch: not even a batch of {plan.decode[0]} fits the {gib(max(left, 0))} "
                                 f"left beside the weights and the KV cache (it needs {gib(need[plan.decode[0]])}); "
                                 f"lower kv_cache_memory_fraction or num_kv_blocks")
        if fitting[-1] < plan.max_batch:
            self.log.warning(f"max_batch {plan.max_batch} cannot fit: its logits and decode step need "
                             f"{gib(need[plan.max_batch])}, and {gib(max(left, 0))} is left beside the weights and "
                             f"the KV cache; serving max_batch {fitting[-1]} instead",
                             max_batch=fitting[-1], configured=plan.max_batch, decode_buckets=fitting)
            return plan.within(fitting[-1])
        return plan

    def _num_kv_blocks(self, model, block_size: int, kv_dtype: torch.dtype) -> int:
        """`num_kv_blocks`, else the blocks of `kv_dtype` that the KV budget holds: the
        `kv_cache_memory_fraction` of the free memory on CUDA, on the CPU the bytes of
        `CPU_DEFAULT_KV_BLOCKS` blocks in the model's dtype (so an FP8 cache has about
        twice the blocks there too)."""
        config = self.config
        if config.num_kv_blocks:
            return config.num_kv_blocks
        if self.device.type != "cuda":
            budget = CPU_DEFAULT_KV_BLOCKS * kv_bytes_per_block(model.config, block_size, model.dtype)
            return budget // kv_bytes_per_block(model.config, block_size, kv_dtype)
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = int(free * config.kv_cache_memory_fraction)
        return max(16, budget // kv_bytes_per_block(model.config, block_size, kv_dtype))

    def serve(self) -> None:
        self.runner.serve_from_this_thread()
        if self.draft is not None:
            self.draft.serve_from_this_thread()
        ack_seen = False
        last_stats = 0.0
        poller = zmq.Poller()
        poller.register(self.ctl.socket, zmq.POLLIN)
        poller.register(self.link.socket, zmq.POLLIN)
        idle_ms = int(self.config.heartbeat_interval_s * 1000)
        poll_until = 0.0  # busy_poll_s after the last step; step_wake_poll_s after an `Expect`
        while not self._stop:
            self.link.heartbeat()
            now = time.monotonic()
            if ack_seen and now - last_stats > STATS_INTERVAL_S:
                last_stats = now
                self.ctl.send(control.Stats(stats=self._stats()))
            events = dict(poller.poll(timeout=0 if now < poll_until else idle_ms))
            if self.link.socket in events:
                while self.link.poll_command() is not None:  # nothing for the graph generator
                    pass
            if self.ctl.socket not in events:
                continue
            try:
                message = self.ctl.recv(timeout_ms=0)
            except ProtocolError as exc:
                self.log.error("bad_control_message", error=str(exc))
                continue
            if message is None:
                continue
            if isinstance(message, control.Step):
                mark("step_received")
                self._step(message)
                poll_until = time.monotonic() + self.config.busy_poll_s
            elif isinstance(message, control.Draft):
                self._draft(message)
                poll_until = time.monotonic() + self.config.busy_poll_s
            elif isinstance(message, control.Expect):
                mark("expect_received")
                poll_until = max(poll_until, time.monotonic() + self.config.step_wake_poll_s)
            elif isinstance(message, control.ReadyAck) and not ack_seen:
                ack_seen = True
                # The peer has mapped the arenas: their names can go, mappings stay valid.
                self.kv_arena.unlink_name()
                self.step_arena.unlink_name()
                self.runner.start_background_capture()
                if self.draft_arena is not None:
                    self.draft_arena.unlink_name()
                if self.draft is not None:
                    self.draft.start_background_capture()
                self.link.phase("ready", "serving")
            elif isinstance(message, control.Shutdown):
                self.loop_exit.commanded("shutdown (from the context generator)")
                self._stop = True
            else:
                self.log.warning("unexpected_control_message", type=type(message).__name__)

    def _step(self, step: control.Step) -> None:
        """Wait for the step's inputs, run it, record its logits, reply: all enqueued, no host wait."""
        stream = self.runner.stream
        self.inputs_ready.wait(stream)
        mark("graph_launch")
        self.runner.run(step.kind == "prefill", step.n_tokens, step.n_real)
        mark("graph_launched")
        self.logits_ready.record(stream)
        self.tracer.step()
        self.link.steps += 1
        mark("launched_send")
        self.ctl.send(control.Launched(step=step.step))
        if self.draft is not None:  # before the next step's forward writes over the hidden states
            self.draft.observe(step, self.buffers.aux_hidden)

    def _draft(self, message: control.Draft) -> None:
        """Drafts for the context generator's sequences (`DraftRunner`); none without a drafter here."""
        if self.draft is None:
            self.log.error("draft_without_a_drafter")
            if message.sequences:
                self.ctl.send(control.Drafted(draft=message.draft, failed=True))
            return
        reply = self.draft.draft(message)
        if reply is not None:
            self.ctl.send(reply)

    def _stats(self) -> dict[str, Any]:
        stats = self.runner.snapshot()
        if self.draft is not None:
            stats[self.config.speculative_drafter] = self.draft.snapshot()
        return stats

    def close(self) -> None:
        self.runner.stop_background_capture() if hasattr(self, "runner") else None
        if getattr(self, "draft", None) is not None:
            self.draft.stop_background_capture()
        for arena in ("kv_arena", "step_arena", "draft_arena"):
            if getattr(self, arena, None) is not None:
                getattr(self, arena).close()
        self.link.phase("stopped")
        self.ctl.close(linger_ms=100)
        self.link.close()


def main(config: dict[str, Any], ctl_endpoint: str) -> None:
    cfg = Config.from_dict(config)
    configure(cfg.log_level, json=cfg.log_format == "json")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; SIGTERM ends us
    worker = GraphGenerator(cfg, ctl_endpoint)
    try:
        start_and_serve(worker)
    finally:
        worker.close()
