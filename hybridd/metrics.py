"""Prometheus exposition of the daemon's `status` map.

Nothing is counted here: every figure is read from one `status` reply, whose request
counters and latency histograms the context generator keeps where it serves the
requests (`hybridd.serving_metrics`), whose graph figures come from the graph
generator and whose restart counts come from the supervisor. `/metrics` therefore
always agrees with `hybridd status`. Names follow vLLM's where the meaning is the
same, with the prefix `hybridd:`; every family carries vLLM's `model_name` label.
Beside them: prometheus_client's process metrics (`process_*`) of the process that
serves /metrics, and the same figures for each of the daemon's processes
(`hybridd:process_*`, labelled by `worker`), read from /proc by their pids.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import PROCESS_COLLECTOR, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "hybridd:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time from a request's arrival to its first generated token.",
    "inter_token_latency_seconds": "Time between two consecutive generated tokens of a request.",
    "e2e_request_latency_seconds": "Time from a request's arrival to its final reply.",
    "request_queue_time_seconds": "Time from a request's arrival to its first scheduled step.",
    "prefill_step_seconds": "Time of an engine step that carried prompt tokens, from its start on the device "
                            "to its tokens on the host.",
    "decode_step_seconds": "Time of an engine step that carried decode tokens only, from its start on the device "
                           "to its tokens on the host.",
    "request_prompt_tokens": "Prompt tokens of each finished request.",
    "request_generation_tokens": "Tokens generated for each finished request.",
}


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def status_families(status: dict[str, Any], model_name: str) -> Iterator[Metric]:
    """The Prometheus metric families of one `status` map (tolerant of missing keys)."""
    base = ["model_name"]
    model = [model_name]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=base)
        family.add_metric(model, value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=base)
        family.add_metric(model, value)
        return family

    requests = status.get("requests") or {}
    metrics = status.get("metrics") or {}
    kv = status.get("kv_blocks") or {}
    yield gauge("num_requests_running", "Sequences in the running batch (a request with n > 1 counts n, as vLLM's child requests).", requests.get("running", 0))
    yield gauge("num_requests_waiting", "Requests waiting to be scheduled or tokenized.", requests.get("queued", 0))
    total = kv.get("total") or 0
    yield gauge("kv_cache_usage_perc", "Fraction of the KV-cache blocks in use (1 = full).",
                kv.get("used", 0) / total if total else 0.0)
    yield counter("prompt_tokens", "Prompt tokens of the requests that finished.", metrics.get("prompt_tokens", 0))
    yield counter("generation_tokens", "Tokens generated for the requests that finished.",
                  metrics.get("generation_tokens", 0))
    finished = CounterMetricFamily(PREFIX + "request_success", "Requests that ended with a final reply, by reason.",
                                   labels=[*base, "finished_reason"])
    for reason, count in sorted((metrics.get("finished") or {}).items()):
        finished.add_metric([*model, reason], count)
    yield finished
    yield counter("num_preemptions", "Sequences preempted (their KV blocks freed, recomputed later).",
                  requests.get("preemptions", 0))
    prefix_cache = status.get("prefix_cache") or {}
    yield counter("prefix_cache_queries", "Prompt tokens of admitted requests looked up in the prefix cache.",
                  prefix_cache.get("queries", 0))
    yield counter("prefix_cache_hits", "Of those prompt tokens, the ones whose KV the prefix cache held.",
                  prefix_cache.get("hits", 0))
    steps = status.get("steps") or {}
    yield counter("steps", "Engine steps scheduled (each a decode, a prefill or both).", steps.get("total", 0))
    yield counter("step_tokens", "Tokens the scheduled steps carried (over steps: tokens per step).",
                  steps.get("tokens", 0))
    yield counter("prefill_steps", "Steps that carried prompt tokens.", steps.get("prefill", 0))
    yield counter("chunked_prefill_steps", "Steps that carried part of a prompt: a chunk that does not end it, "
                  "or that starts after its first token (behind an earlier chunk or a cached prefix).",
                  steps.get("chunked_prefill", 0))
    yield counter("mixed_steps", "Steps that carried prompt tokens and running streams' decode tokens together.",
                  steps.get("mixed", 0))
    speculation = status.get("speculation") or {}
    yield counter("spec_decode_num_drafts", "Drafts verified (a sequence's draft tokens in one verify step).",
                  speculation.get("drafts", 0))
    yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                  speculation.get("draft_tokens", 0))
    yield counter("spec_decode_num_accepted_tokens", "Draft tokens the model accepted.",
                  speculation.get("accepted_tokens", 0))
    per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted draft tokens by their position in the draft (0 first).",
                                       labels=[*base, "position"])
    for position, count in enumerate(speculation.get("accepted_per_position") or []):
        per_position.add_metric([*model, str(position)], count)
    yield per_position
    for name, doc in HISTOGRAM_HELP.items():
        histogram = (metrics.get("histograms") or {}).get(name)
        if histogram is None:
            continue
        family = HistogramMetricFamily(PREFIX + name, doc, labels=base)
        cumulative, buckets = 0, []
        for bound, count in zip([*histogram["bounds"], math.inf], histogram["counts"], strict=True):
            cumulative += count
            buckets.append((_le(bound), cumulative))
        family.add_metric(model, buckets, sum_value=histogram["sum"])
        yield family
    yield from _graph_families(status, base, model)
    restarts = CounterMetricFamily(PREFIX + "worker_restarts", "Restarts of each supervised process.",
                                   labels=[*base, "worker"])
    for worker, info in sorted((status.get("workers") or {}).items()):
        restarts.add_metric([*model, worker], info.get("restarts", 0))
    yield restarts
    yield from _process_families(status, base, model)


def _process_families(status: dict[str, Any], base: list[str], model: list[str]) -> Iterator[Metric]:
    """prometheus_client's process figures of each of the daemon's processes, by worker."""
    pids = {name: info.get("pid") for name, info in (status.get("workers") or {}).items()}
    pids.setdefault("gateway", os.getpid())
    families: dict[str, Metric] = {}
    for worker, pid in sorted(pids.items()):
        if not isinstance(pid, int) or pid <= 0:
            continue
        for family in ProcessCollector(namespace="", pid=lambda pid=pid: pid, registry=None).collect():
            kind = CounterMetricFamily if family.type == "counter" else GaugeMetricFamily
            name = PREFIX + family.name
            if name not in families:
                families[name] = kind(name, family.documentation, labels=[*base, "worker"])
            for sample in family.samples:
                families[name].add_metric([*model, worker], sample.value)
    yield from families.values()


def _graph_families(status: dict[str, Any], base: list[str], model: list[str]) -> Iterator[Metric]:
    buckets = status.get("buckets") or []
    replays = CounterMetricFamily(PREFIX + "graph_replays", "Steps run by replaying a captured CUDA graph.",
                                  labels=[*base, "kind", "size"])
    eager = CounterMetricFamily(PREFIX + "graph_eager_runs", "Steps run eagerly because their bucket had no graph.",
                                labels=[*base, "kind", "size"])
    for bucket in buckets:
        labels = [*model, str(bucket.get("kind")), str(bucket.get("size"))]
        replays.add_metric(labels, bucket.get("replays", 0))
        eager.add_metric(labels, bucket.get("eager_runs", 0))
    yield replays
    yield eager
    captures = CounterMetricFamily(PREFIX + "graph_captures", "CUDA graphs captured (re-captures included).",
                                   labels=base)
    captures.add_metric(model, sum(b.get("captures", 0) for b in buckets))
    yield captures
    evictions = CounterMetricFamily(PREFIX + "graph_evictions", "CUDA graphs evicted to stay within the budget.",
                                    labels=base)
    evictions.add_metric(model, sum(b.get("evictions", 0) for b in buckets))
    yield evictions
    memory = GaugeMetricFamily(PREFIX + "graph_memory_bytes", "Device memory held by captured graphs.", labels=base)
    memory.add_metric(model, status.get("graph_bytes", 0))
    yield memory


class _StatusCollector:
    def __init__(self, status: dict[str, Any], model_name: str) -> None:
        self.status = status
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        return status_families(self.status, self.model_name)


def render(status: dict[str, Any], model_name: str) -> bytes:
    """The Prometheus text exposition of one `status` map."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(status, model_name))
    registry.register(PROCESS_COLLECTOR)
    return generate_latest(registry)
