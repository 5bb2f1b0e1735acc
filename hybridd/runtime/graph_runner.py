"""The graph runner: the static domain's forward, replayed from CUDA Graphs per bucket.

Decode graphs (one per batch-size bucket) are captured before the daemon is ready,
largest first. Prefill graphs (one per token-count bucket, holding `max_prefill_seqs`
rows) and mixed graphs (the token counts of a chunked-prefill step, a prefill step whose
first rows are every running stream's decode, holding `BucketPlan.max_rows` rows, so a
prompt chunk beside a full batch of streams replays a graph too) are captured afterwards
by a background thread, most-demanded first, into a rolling set bounded by a memory
budget with least-recently-used eviction; until a bucket exists its steps run eagerly
or pad into a larger captured bucket. All graphs share one memory pool, and each is
uploaded to the device right after its capture, so that no replay pays for the upload.

Concurrency: captures happen on a side stream with `capture_error_mode="thread_local"`
through `capture_begin/end` directly (the `torch.cuda.graph` helper would synchronize
the device and empty the allocator cache, stalling serving). Warm-up runs use private
inputs whose slots are all -1, so they never touch live buffers or real KV blocks.
Replays and evictions take one lock, so a graph is never destroyed between its lookup
and its launch; all replays go to one serving stream, so graphs that share pool memory
never run at the same time. Without CUDA, a "graph" is the same step body run eagerly
on the padded buffers, so the bucket, padding, budget and eviction logic is the same.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from hybridd.log import get_logger
from hybridd.model.kv_cache import KVCache
from hybridd.model.llama import LlamaModel
from hybridd.model.step_inputs import StepInputs
from hybridd.runtime import buckets as bucket_rules
from hybridd.runtime import gc_pauses
from hybridd.runtime.buckets import BucketPlan
from hybridd.runtime.graph_memory import activation_bytes, pool_bytes
from hybridd.runtime.graph_stats import BucketStats
from hybridd.runtime.kernel_precompile import CompilePool, PrecompileReport, precompile
from hybridd.runtime.serving_stream import ServingStream
from hybridd.runtime.step_buffers import StepBuffers

log = get_logger("graph_runner")

CAPTURE_REMEDIES = (
    "1. lower graph_memory_budget_mb, or drop the largest sizes from prefill_buckets / decode_buckets",
    "2. lower kv_cache_memory_fraction (or num_kv_blocks) to leave device memory for graphs",
    "3. lower max_batch so that the largest decode bucket is smaller",
    "4. set use_cuda_graphs = false to serve every step eagerly",
)


SERVING_SWITCH_INTERVAL_S = 0.0002


@dataclass(frozen=True)
class StepShape:
    """How one step runs: its padded size and whether a graph replays it."""

    is_prefill: bool
    tokens: int
    seqs: int
    graph: bool
    bucket: int | None


class _EagerGraph:
    """The CPU stand-in for a captured graph: replays the step body eagerly."""

    def __init__(self, body):
        self._body = body

    def replay(self) -> None:
        self._body()


def prefill_warm_up_sizes(buckets: list[int], skinny_rows: int) -> list[int]:
    """The prefill sizes a capturing thread warms up at: the smallest bucket, and the
    smallest with more tokens than the skinny projections take (its projections run on
    cuBLAS, as those of every larger bucket do)."""
    sizes = [min(buckets)]
    past = [b for b in buckets if b > skinny_rows]
    if past and min(past) not in sizes:
        sizes.append(min(past))
    return sizes


class GraphRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        buffers: StepBuffers,
        plan: BucketPlan,
        *,
        use_graphs: bool = True,
        memory_budget_bytes: int = 1 << 30,
        pad_factor: float = 4.0,
        stream: torch.cuda.Stream | None = None,
        aux_layers: tuple[int, ...] = (),
    ):
        """`aux_layers`: the layers whose residual stream every step also writes to
        `buffers.aux_hidden` (a drafter reads them: EAGLE-3); none by default."""
        self.model = model
        self.aux_layers = aux_layers
        if aux_layers and buffers.aux_hidden is None:
            raise ValueError("aux_layers need the step buffers' aux_hidden region")
        self.kv_cache = kv_cache
        self.buffers = buffers
        self.plan = plan
        self.device = model.device
        self.use_graphs = use_graphs
        self.cuda = use_graphs and self.device.type == "cuda"
        self.memory_budget_bytes = memory_budget_bytes
        self.pad_factor = pad_factor
        # The pool graphs are captured into now; every pool used so far, each with its anchor.
        self.pool: tuple[int, int] | None = None
        self._pools: list[tuple[tuple[int, int], torch.cuda.CUDAGraph, torch.Tensor]] = []
        # Each pool's segment bytes, measured when it opens and after each capture into it:
        # a pool with a live graph grows only while a graph is captured into it and never
        # shrinks, so the status report need not walk the allocator's snapshot every time.
        self._pool_bytes: dict[tuple[int, int], int] = {}
        # Each pool's bytes that no live graph is charged for: what evicted graphs and failed
        # captures left in it. The pool never shrinks, so the next capture into it reuses that
        # memory before growing the pool, and is charged for what it reuses. A pool's bytes
        # are always its live graphs' charges plus its unowned bytes.
        self._unowned_bytes: dict[tuple[int, int], int] = {}
        self._graph_pools: dict[tuple[str, int], tuple[int, int] | None] = {}
        # Serving never uses the legacy default stream: it synchronizes implicitly with every
        # blocking stream, which is an error while the background thread captures.
        on_cuda = self.device.type == "cuda"
        self.stream = stream if stream is not None else (torch.cuda.Stream(self.device) if on_cuda else None)
        self.capture_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.serving = ServingStream(self.stream)
        if self.cuda:
            self._open_pool()
        if plan.max_rows > buffers.max_seqs:
            raise ValueError("step buffers hold fewer sequences than the bucket plan needs")
        if max(plan.max_batch, plan.max_prefill_tokens) > buffers.max_tokens:
            raise ValueError("step buffers hold fewer tokens than the largest bucket")
        self.stats: dict[tuple[str, int], BucketStats] = {}
        for size in plan.decode:
            self.stats[("decode", size)] = BucketStats("decode", size)
        for size in plan.prefill:
            self.stats[("prefill", size)] = BucketStats("prefill", size)
        for size in plan.mixed:
            self.stats[("mixed", size)] = BucketStats("mixed", size)
        self._decode_graphs: dict[int, object] = {}
        # Prefill and mixed graphs by (kind, size), in LRU order, oldest first.
        self._prefill_graphs: OrderedDict[tuple[str, int], object] = OrderedDict()
        self._lock = threading.Lock()
        self._demand_changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._retired: list[tuple[object, torch.cuda.Event]] = []
        self._warm_threads: set[int] = set()

    # ---------------------------------------------------------------- planning
    def plan_step(self, is_prefill: bool, num_tokens: int, num_seqs: int) -> StepShape:
        """Pick the graph bucket for a step, or eager at the exact size."""
        eager = StepShape(is_prefill, num_tokens, num_seqs, False, None)
        if not is_prefill:
            bucket = bucket_rules.pick(self.plan.decode, num_seqs)
            if bucket is None:
                return eager
            with self._lock:
                captured = bucket in self._decode_graphs
                if not captured:
                    self.stats[("decode", bucket)].eager_runs += 1
            if not captured:
                return eager
            return StepShape(False, bucket, bucket, True, bucket)

        kind = self.plan.step_kind(num_seqs)
        sizes = self.plan.mixed if kind == "mixed" else self.plan.prefill
        exact = bucket_rules.pick(sizes, num_tokens)
        if exact is None or num_seqs > self.plan.rows(kind):
            return eager
        with self._lock:
            self.stats[(kind, exact)].demand += 1
            if (kind, exact) not in self._prefill_graphs:
                # Only demand for a bucket without a graph can start a capture. Waking the
                # capture thread for the others would have it contend for this lock and
                # the GIL while this step is being launched.
                self._demand_changed.notify_all()
            candidates = [b for b in sizes if b >= exact and (kind, b) in self._prefill_graphs]
            chosen = candidates[0] if candidates and candidates[0] <= exact * self.pad_factor else None
            if chosen is None:
                self.stats[(kind, exact)].eager_runs += 1
        if chosen is None:
            return eager
        return StepShape(True, chosen, self.plan.rows(kind), True, chosen)

    # --------------------------------------------------------------- execution
    def run(self, is_prefill: bool, num_tokens: int, num_seqs: int) -> StepShape:
        """Run one step written to the buffers (`StepBuffers.write`: its real rows, padding
        past them), on the serving stream: pick its bucket and replay the bucket's graph
        (or run eagerly). `num_seqs` counts the step's rows: its sequences, or its logits
        rows where a prefill step has more (`StepFields.logits_indices`); their logits
        land in `buffers.logits[:num_seqs]`."""
        shape = self.plan_step(is_prefill, num_tokens, num_seqs)
        with self.serving.entered():
            self._execute(shape)
        return shape

    def serve_from_this_thread(self) -> None:
        """Run this thread's steps on the serving stream without a switch each (`ServingStream`)."""
        self.serving.bind_this_thread()

    def _execute(self, shape: StepShape) -> None:
        if shape.graph:
            key = (self._kind_of(shape), shape.bucket)
            with self._lock:
                if shape.is_prefill:
                    graph = self._prefill_graphs.get(key)
                    if graph is not None:
                        self._prefill_graphs.move_to_end(key)
                else:
                    graph = self._decode_graphs.get(shape.bucket)
                if graph is not None:
                    self.stats[key].replays += 1
                    graph.replay()
                    return
            # Evicted between planning and execution: the padded inputs serve the eager run.
        self._step_body(self.buffers.view(shape.is_prefill, shape.tokens, shape.seqs), self.buffers.logits)

    def _kind_of(self, shape: StepShape) -> str:
        if not shape.is_prefill:
            return "decode"
        return "mixed" if shape.seqs > self.plan.max_prefill_seqs else "prefill"

    @torch.inference_mode()
    def _step_body(self, view: StepInputs, logits_out: torch.Tensor) -> None:
        if self.aux_layers:
            hidden, aux = self.model.forward_aux(view, self.kv_cache, self.aux_layers)
            self.buffers.aux_hidden[: view.num_tokens].copy_(aux)
        else:
            hidden = self.model(view, self.kv_cache)
        logits_out[: view.num_seqs].copy_(self.model.compute_logits(hidden, view.logits_indices))

    # ----------------------------------------------------------------- capture
    def precompile_kernels(self, pool: CompilePool) -> PrecompileReport | None:
        """Compile the Triton kernels that capturing the decode graphs and warming up
        prefill will launch, in `pool`'s processes at once, before either runs (CUDA with
        graphs; `kernel_precompile`). Their warm-ups then load the kernels from Triton's
        cache instead of compiling them one after another. A failure is logged and leaves
        the compiling to those warm-ups, as without it."""
        if not self.cuda:
            return None

        def dry_runs() -> None:  # the warm-ups of every decode bucket and of prefill
            for size in sorted(self.plan.decode):
                self._warm_up_steps("decode", size)
            for kind in self._prefill_kinds():
                self._warm_up_steps(kind, min(self.plan.prefill))

        try:
            return precompile(dry_runs, pool)
        except Exception as exc:  # the warm-ups compile what is missing, one by one
            log.warning("kernel_precompile_failed", error=f"{type(exc).__name__}: {str(exc)[:200]}",
                        consequence="the warm-ups compile the kernels one after another")
            return None

    def capture_decode_graphs(self, progress=None) -> None:
        """Capture every decode bucket, largest first (before the daemon is ready)."""
        if not self.use_graphs:
            return
        sizes = sorted(self.plan.decode, reverse=True)
        for done, size in enumerate(sizes, 1):
            self._capture("decode", size)
            if progress is not None:
                progress(done, len(sizes))

    def warm_up_prefill(self) -> None:
        """Compile the prefill step's kernels on the serving thread, before ready (CUDA).

        A prefill whose bucket the background thread has not captured yet runs eagerly
        on the serving thread; without this its first one would compile the prefill
        kernels there (seconds, with cold caches: every stream waits), as the first
        request after ready once did. The background thread then finds them compiled.
        The sizes are those a capturing thread warms up at (`prefill_warm_up_sizes`).
        A failure (out of memory) is logged and the daemon still starts, as a failed
        capture disables only its bucket."""
        if self.device.type != "cuda":
            return
        # With graphs one call warms every such size (once per thread); without, one call each.
        sizes = [min(self.plan.prefill)] if self.cuda else prefill_warm_up_sizes(
            self.plan.prefill, self.model.kernels.skinny_rows)
        try:
            for kind in self._prefill_kinds():
                for size in sizes:
                    self._warm_up(kind, size)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # the start goes on; the first prefills compile while serving
            log.warning("prefill_warm_up_failed", error=f"{type(exc).__name__}: {str(exc)[:200]}",
                        consequence="the first prefills compile their kernels while serving")
            torch.cuda.empty_cache()

    def _prefill_kinds(self) -> tuple[str, ...]:
        return ("prefill", "mixed") if self.plan.mixed else ("prefill",)

    def _shape_of(self, kind: str, size: int) -> tuple[int, int]:
        """(tokens, rows) of a bucket's graph. Every prefill bucket of a kind holds that
        kind's rows (`BucketPlan.rows`), even those with fewer tokens: the prefill kernels
        are compiled per padded row count (`_warm_up`), so one count per kind means one
        warm-up compiles them all and no capture compiles inside itself."""
        return (size, size) if kind == "decode" else (size, self.plan.rows(kind))

    def _dummy_inputs(self, is_prefill: bool, tokens: int, seqs: int) -> StepInputs:
        """A bucket-shaped step on private buffers of the live ones' layout: the same
        dtypes, offsets and strides as `buffers.view`'s, so the kernels it compiles are
        those a capture or an eager run of that view launches. Its slots are all -1: it
        writes nothing to the KV cache."""
        live = self.buffers
        # No logits of its own: the buffers take their sequence count from the logits'
        # rows, and a warm-up writes its logits to scratch (`_scratch_logits`).
        private = StepBuffers({"step_inputs": torch.zeros_like(live.packed), "logits": live.logits[:, :0]},
                              live.max_tokens, live.max_blocks_per_seq)
        view = private.view(is_prefill, tokens, seqs)
        per_seq = max(1, tokens // seqs)
        starts = [min(i * per_seq, tokens) for i in range(seqs)] + [tokens]
        view.slot_mapping.fill_(-1)
        view.seq_lens.fill_(1)
        view.query_start_loc.copy_(torch.tensor(starts, dtype=view.query_start_loc.dtype))
        return view

    def _estimate_bytes(self, kind: str, size: int) -> int:
        stats = self.stats[(kind, size)]
        if stats.bytes:
            return stats.bytes
        tokens, seqs = self._shape_of(kind, size)
        elem = torch.finfo(self.model.dtype).bits // 8
        return activation_bytes(self.model.config, tokens, seqs, elem)

    def _capture(self, kind: str, size: int) -> bool:
        key = (kind, size)
        is_prefill = kind != "decode"
        stats = self.stats[key]
        tokens, seqs = self._shape_of(kind, size)
        started = time.perf_counter()
        pool = self.pool
        need = self._estimate_bytes(kind, size)
        uploaded = False
        try:
            self._warm_up(kind, tokens)
            view = self.buffers.view(is_prefill, tokens, seqs)
            if self.cuda:
                graph = torch.cuda.CUDAGraph()
                self._capture_graph(graph, view)
                uploaded = self._upload(graph, key)
            else:
                graph = _EagerGraph(lambda: self._step_body(view, self.buffers.logits))
        except Exception as exc:  # a failed capture disables the bucket, never the process
            stats.disabled = f"capture failed: {type(exc).__name__}: {str(exc)[:200]}"
            log.error(
                "graph_capture_failed",
                kind=key[0],
                size=size,
                error=stats.disabled,
                remedies="\n".join(CAPTURE_REMEDIES),
            )
            if self.cuda:
                torch.cuda.empty_cache()
                after = pool_bytes(pool)  # what the failed capture left in it belongs to no graph
                with self._lock:
                    self._unowned_bytes[pool] = (self._unowned_bytes.get(pool, 0)
                                                 + max(0, after - self._pool_bytes.get(pool, 0)))
                    self._pool_bytes[pool] = after
            return False
        # Its cost is what the capture added to the graphs' pool, plus the pool memory no
        # live graph holds that it took over (up to what it was expected to need). The drop
        # in the device's free memory would also charge it with whatever the serving thread
        # or the other worker allocated meanwhile (the same GPU, under MPS the same memory).
        if self.cuda:
            pool_after = pool_bytes(pool)
            grown = max(0, pool_after - self._pool_bytes.get(pool, 0))
        else:
            pool_after, grown = 0, self._estimate_bytes(kind, size)
        with self._lock:
            used = grown
            if self.cuda:
                self._pool_bytes[pool] = pool_after
                unowned = self._unowned_bytes.get(pool, 0)
                taken = min(unowned, max(0, need - grown))
                self._unowned_bytes[pool] = unowned - taken
                used += taken
                self._graph_pools[key] = pool
            if is_prefill:
                self._prefill_graphs[key] = graph
            else:
                self._decode_graphs[size] = graph
            stats.captured = True
            stats.captures += 1
            stats.uploaded = uploaded
            stats.bytes = used
            stats.capture_s = time.perf_counter() - started
        log.info("graph_captured", kind=key[0], size=size, bytes=used, seconds=round(stats.capture_s, 4))
        return True

    def _warm_up(self, kind: str, tokens: int) -> None:
        """One eager run on private inputs (slots all -1): lazy init and kernel compilation
        happen here, not during capture, and live buffers are left alone.

        On CUDA a thread warms up prefill once, at the smallest size and at the smallest
        size past the rows the skinny projections take (the first whose projections go to
        cuBLAS: a thread's first cuBLAS call creates its handle, which would invalidate a
        capture): a full-size warm-up of a large prefill bucket would compete with serving
        for the GPU while the background thread runs. Decode buckets are small and captured
        before serving, so each is warmed up at its own size: a kernel specialised on a row
        count then compiles here, never inside the capture (which it would invalidate)."""
        if not self.cuda:
            _, seqs = self._shape_of(kind, tokens)
            self._step_body(self._dummy_inputs(kind != "decode", tokens, seqs), self._scratch_logits(seqs))
            return
        key = (threading.get_ident(), kind, tokens if kind == "decode" else None)
        if key in self._warm_threads:
            return
        self._warm_up_steps(kind, tokens)
        # Only a warm-up that ran counts: one that failed (out of memory) is redone
        # before the next capture, or that capture would compile inside itself.
        self._warm_threads.add(key)

    def _warm_up_steps(self, kind: str, tokens: int) -> None:
        """The steps a CUDA warm-up runs (`_warm_up`), on the capture stream, waited for."""
        is_prefill = kind != "decode"
        sizes, seqs = [tokens], tokens
        if is_prefill:
            seqs = self.plan.rows(kind)
            sizes = prefill_warm_up_sizes(self.plan.prefill, self.model.kernels.skinny_rows)
        scratch_logits = self._scratch_logits(seqs)
        with torch.cuda.stream(self.capture_stream):
            for size in sizes:
                self._step_body(self._dummy_inputs(is_prefill, size, seqs), scratch_logits)
        self.capture_stream.synchronize()

    def _scratch_logits(self, seqs: int) -> torch.Tensor:
        return torch.empty((seqs, self.model.config.vocab_size), device=self.device)

    def _upload(self, graph: torch.cuda.CUDAGraph, key: tuple[str, int]) -> bool:
        """Upload a captured graph's executable to the device now (cudaGraphUpload on the
        capture stream), so that its first replay, often a request's first token, does
        not pay for the upload while the GPU waits. Without the means (a PyTorch without
        `raw_cuda_graph_exec`, no cupy) or on an error the graph still serves: its first
        launch uploads it. Returns whether it was uploaded."""
        raw_exec = getattr(graph, "raw_cuda_graph_exec", None)
        if raw_exec is None:
            return False
        try:
            import cupy

            with cupy.cuda.Device(self.device.index or 0):
                cupy.cuda.runtime.graphUpload(raw_exec(), self.capture_stream.cuda_stream)
            # A replay from the serving stream must not race the upload.
            self.capture_stream.synchronize()
        except Exception as exc:  # the launch uploads it instead
            log.warning("graph_upload_failed", kind=key[0], size=key[1], error=f"{type(exc).__name__}: {exc}"[:200])
            return False
        return True

    def _open_pool(self) -> None:
        """Capture into a new pool from now on, anchored by a one-kernel graph that lives as
        long as the runner. PyTorch counts a pool's users by its graphs; were they all
        released (the first capture failed, every prefill graph evicted), it would refuse
        the pool's id at the next capture."""
        pool = torch.cuda.graph_pool_handle()
        cell = torch.zeros(1, device=self.device)
        anchor = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.capture_stream):
            anchor.capture_begin(pool=pool, capture_error_mode="thread_local")
            cell.add_(1)
            anchor.capture_end()
        self.capture_stream.synchronize()
        self._pools.append((pool, anchor, cell))
        self._pool_bytes[pool] = pool_bytes(pool)
        self.pool = pool

    def _capture_graph(self, graph: torch.cuda.CUDAGraph, view: StepInputs) -> None:
        with gc_pauses.no_collection():
            with torch.cuda.stream(self.capture_stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    self._step_body(view, self.buffers.logits)
                finally:
                    try:
                        graph.capture_end()
                    except Exception:
                        # A failed end of capture can leave the allocator routing this
                        # thread's allocations to the pool; stop that so later captures work.
                        try:
                            torch._C._cuda_endAllocateToPool(self.device.index or 0, self.pool)
                        except Exception:  # already ended by capture_end
                            pass
                        self._replace_pool()
                        raise

    def _replace_pool(self) -> None:
        """A capture the CUDA runtime invalidated leaves its pool marked as recording in a
        part of PyTorch's allocators that cannot be told to stop (seen with torch 2.11:
        every later capture into it is refused, "already recording to mempool_id"); later
        captures go to a new pool, and the graphs already in the old one keep it."""
        try:
            self._open_pool()
            log.warning("graph_pool_replaced", pools=len(self._pools))
        except Exception as exc:  # the bucket stays disabled either way; later captures may fail too
            log.error("graph_pool_replace_failed", error=f"{type(exc).__name__}: {exc}"[:200])

    # ------------------------------------------------------ background capture
    def start_background_capture(self) -> None:
        if not self.use_graphs or self._thread is not None:
            return
        self._stop.clear()
        # Capturing is Python-heavy; a short switch interval bounds how long the serving
        # thread waits for the GIL behind it (the default is 5 ms, longer than a step).
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SERVING_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._capture_loop, name="prefill-capture", daemon=True)
        self._thread.start()

    def stop_background_capture(self, timeout: float | None = 30.0) -> None:
        self._stop.set()
        with self._lock:
            self._demand_changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
            sys.setswitchinterval(self._switch_interval)

    def _next_prefill_bucket(self) -> tuple[str, int] | None:
        """The next (kind, size) to capture: the most demanded, then prefill before mixed
        (a prompt alone is the first thing a client waits for), then the smallest."""
        keys = [("prefill", s) for s in self.plan.prefill] + [("mixed", s) for s in self.plan.mixed]
        pending = [
            key for key in keys
            if key not in self._prefill_graphs and self.stats[key].disabled is None and not self._blocked_by_budget(key)
        ]
        if not pending:
            return None
        return min(pending, key=lambda key: (-self.stats[key].demand, key[0] == "mixed", key[1]))

    def _blocked_by_budget(self, key: tuple[str, int]) -> bool:
        """True when capturing `key` would need evicting graphs at least as wanted as it."""
        need = self._estimate_bytes(*key)
        free = self.memory_budget_bytes - self.graph_bytes()
        if need <= free:
            return False
        demand = self.stats[key].demand
        reclaimable = sum(self.stats[k].bytes for k in self._prefill_graphs if self.stats[k].demand < demand)
        return need > free + reclaimable

    def _capture_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                key = self._next_prefill_bucket()
                if key is None:
                    self._demand_changed.wait(timeout=1.0)
                    continue
                need = self._estimate_bytes(*key)
                self._evict_for(need, self.stats[key].demand)
                finished, waiting = [], []
                for graph, done in self._retired:
                    if done.query():
                        finished.append(graph)
                    else:
                        waiting.append((graph, done))
                self._retired = waiting
            self._destroy(finished)
            self._capture(*key)

    @staticmethod
    def _destroy(graphs: list[torch.cuda.CUDAGraph]) -> None:
        """Destroy evicted graphs whose replays have run, outside the lock, which a replay
        would otherwise wait for while a graph's executable is freed. `reset()` releases the
        GIL while it frees; dropping the last reference would free it with the GIL held,
        stalling the serving thread as well."""
        for graph in graphs:
            graph.reset()

    def _evict_for(self, need: int, demand: int) -> None:
        """Evict least-recently-used, less-demanded prefill and mixed graphs until `need`
        fits (lock held)."""
        for victim in list(self._prefill_graphs):
            if self.memory_budget_bytes - self.graph_bytes() >= need:
                return
            stats = self.stats[victim]
            if stats.demand >= demand:
                continue
            graph = self._prefill_graphs.pop(victim)
            if self.cuda:
                # Its replays were enqueued under this lock; destroy it once they have run.
                done = torch.cuda.Event()
                done.record(self.stream)
                self._retired.append((graph, done))
            stats.captured = False
            stats.evictions += 1
            pool = self._graph_pools.pop(victim, None)
            if pool is not None:  # its memory stays in the pool, for the next capture into it
                self._unowned_bytes[pool] = self._unowned_bytes.get(pool, 0) + stats.bytes
            log.info("graph_evicted", kind=victim[0], size=victim[1], bytes=stats.bytes)

    # ------------------------------------------------------------------- stats
    def graph_bytes(self) -> int:
        """Device memory held by live graphs (captured buckets' measured costs)."""
        return sum(s.bytes for s in self.stats.values() if s.captured)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "use_graphs": self.use_graphs,
                "device": str(self.device),
                "memory_budget_bytes": self.memory_budget_bytes,
                "graph_bytes": self.graph_bytes(),
                "pool_bytes": sum(self._pool_bytes.values()),
                "unowned_pool_bytes": sum(self._unowned_bytes.values()),
                "buckets": [s.to_dict() for s in self.stats.values()],
            }
