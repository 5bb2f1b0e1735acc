"""The daemon's status report, as the context generator answers `status` and `health`
(protocol/SPEC.md lists its fields).

It gathers what the serving process's parts count: the lifecycle state (the
supervisor's word, which the supervisor's `SupervisorInfo` commands bring, unless the
process is draining), the model and device, the graph generator's buckets and memory
(its `Stats` messages), the KV blocks and the prefix cache, requests, steps,
speculation, latencies and metrics, messages refused while being read (counted by the
client sockets), and reply rings.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridd.config import Config, resolve_dtype, resolve_kv_cache_dtype
from hybridd.engine.core import EngineCore
from hybridd.protocol import control
from hybridd.version import __version__
from hybridd.workers.admission import Admission
from hybridd.workers.intake import Intake
from hybridd.workers.replies import Replies

if TYPE_CHECKING:
    import torch

    from hybridd.engine.speculation.speculator import Speculator


class StatusReport:
    """The `status` reply's fields and the lifecycle state, read from the serving process's parts."""

    def __init__(self, config: Config, device: torch.device, ready: control.Ready, core: EngineCore,
                 speculator: Speculator | None, intake: Intake, admission: Admission, replies: Replies, *,
                 rejected: Callable[[], dict[str, int]], started: float, supervised: bool,
                 state: Callable[[], str]) -> None:
        self.config = config
        self.device = device
        self.ready = ready
        self.core = core
        self.scheduler = core.scheduler
        self.speculator = speculator
        self.intake = intake
        self.admission = admission
        self.replies = replies
        self.rejected = rejected  # the client sockets' count of messages refused while being read
        self.started = started
        self.supervised = supervised  # False only for a pair started without a supervisor (tests)
        self.state = state  # the serving process's own state
        self.supervisor_info: dict[str, Any] = {}  # the supervisor's last SupervisorInfo
        self.graph_stats: dict[str, Any] = {}  # the graph generator's last Stats

    def lifecycle_state(self) -> str:
        state = self.state()
        if state == "draining":
            return "draining"
        return self.supervisor_info.get("state", "starting" if self.supervised else state)

    def status(self) -> dict[str, Any]:
        graph = self.graph_stats
        bm = self.scheduler.block_manager
        info = self.supervisor_info
        replies = self.replies
        rings = replies.rings
        return {
            "state": self.lifecycle_state(),
            "uptime_s": info.get("uptime_s", time.time() - self.started),
            "started_at": info.get("started_at", self.started),
            "model": self.config.model,
            "dtype": str(resolve_dtype(self.config, self.device)).removeprefix("torch."),
            "device": str(self.device),
            "kv_cache_dtype": str(resolve_kv_cache_dtype(self.config, resolve_dtype(self.config, self.device)))
            .removeprefix("torch."),
            "quantization": self.ready.quantization or None,
            "workers": info.get("workers", {"context": {"pid": os.getpid(), "restarts": 0},
                                            "graph": {"pid": self.ready.pid, "restarts": 0}}),
            "buckets": graph.get("buckets", []),
            "graph_bytes": graph.get("graph_bytes", 0),
            "graph_pool_bytes": graph.get("pool_bytes", 0),
            "graph_memory_budget_bytes": graph.get("memory_budget_bytes", self.config.graph_memory_budget_mb << 20),
            "kv_blocks": {"total": bm.num_blocks, "used": bm.num_blocks - bm.num_free, "free": bm.num_free},
            "kv_usage": (bm.num_blocks - bm.num_free) / bm.num_blocks if bm.num_blocks else 0.0,
            "version": __version__,
            "max_model_len": self.ready.max_model_len,
            "max_prompt_chars": self.intake.max_prompt_chars,
            "vocab_size": self.ready.vocab_size,
            "rejected": self.rejected(),
            "tokens_per_s": self.core.throughput.per_second(),
            "endpoints": {"ipc": self.config.client_endpoint, "tcp": self.config.tcp_endpoint or None},
            "restarts": info.get("workers", {}).get("context", {}).get("restarts", 0),
            "last_restart_reason": info.get("last_failure") or None,
            "cuda_mps": info.get("cuda_mps") or None,
            "requests": {"running": len(self.scheduler.running),
                         "queued": len(self.scheduler.waiting) + len(self.admission),
                         "served": replies.served, "failed": replies.failed,
                         "preemptions": self.scheduler.num_preemptions},
            # In prompt tokens, as vLLM's prefix_cache_queries / prefix_cache_hits.
            "prefix_cache": {"enabled": bm.enable_prefix_caching, "queries": bm.prefix_cache_queries,
                             "hits": bm.prefix_cache_hits, "cached_blocks": bm.num_cached_blocks},
            "steps": self._steps(),
            "speculation": self._speculation(),
            "latency": replies.metrics.latency(),
            "metrics": replies.metrics.to_status(),
            "reply_rings": {"attached": len(rings), "written": rings.written,
                            "left_out": rings.left_out, "wakes": rings.wakes},
        }

    def _steps(self) -> dict[str, Any]:
        """What the scheduled steps carried since the worker started (chunked prefill's
        counters)."""
        stats = self.scheduler.stats
        return {"total": stats.steps, "tokens": stats.tokens, "tokens_per_step": stats.tokens_per_step,
                "prefill": stats.prefill_steps, "chunked_prefill": stats.chunked_prefill_steps,
                "mixed": stats.mixed_steps}

    def _speculation(self) -> dict[str, Any]:
        """Speculative decoding's counters (vLLM's spec_decode_*), and the policy's measured
        milliseconds per token by batch size, speculating and not."""
        if self.speculator is None:
            return {"drafter": "none"}
        speculation = {"drafter": self.speculator.drafter.name, "num_speculative_tokens": self.speculator.max_tokens,
                       **self.speculator.stats.to_dict(), "ms_per_token": self.speculator.policy.snapshot()}
        name = self.speculator.drafter.name
        if name in self.graph_stats:  # a draft model's or an EAGLE-3 head's KV arena and graphs, in the graph generator
            speculation[name] = self.graph_stats[name]
        return speculation
