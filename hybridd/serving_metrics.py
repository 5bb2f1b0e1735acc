"""What the context generator counts about the requests it serves, for Prometheus.

Counters (tokens, finished requests by reason) and latency histograms (time to first
token, inter-token latency, end-to-end latency, queue time) are kept where the
request is served, so that the figures `/metrics` shows are the same ones `status`
reports. They travel in the `status` reply under `metrics` (see protocol/SPEC.md) and
are turned into Prometheus families by `hybridd.metrics`; they count from the start
of the worker pair (a restart resets them, which Prometheus reads as a counter reset).
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

# Bucket upper bounds in seconds. hybridd's latencies go far below vLLM's first
# buckets (a decode step is about a millisecond), so each list starts finer and then
# follows vLLM's.
TTFT_BOUNDS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BOUNDS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BOUNDS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

HISTOGRAMS = {
    "time_to_first_token_seconds": TTFT_BOUNDS_S,
    "inter_token_latency_seconds": ITL_BOUNDS_S,
    "e2e_request_latency_seconds": REQUEST_BOUNDS_S,
    "request_queue_time_seconds": REQUEST_BOUNDS_S,
}
FINISH_REASONS = ("stop", "length", "cancelled", "timeout", "error")


class Histogram:
    """Counts per bucket (the last one is +Inf), their sum and total; not cumulative."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_status(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": sum(self.counts)}


class ServingMetrics:
    """The context generator's request counters and latency histograms."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter({reason: 0 for reason in FINISH_REASONS})

    def first_token(self, seconds: float) -> None:
        self.histograms["time_to_first_token_seconds"].observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.histograms["inter_token_latency_seconds"].observe(seconds)

    def scheduled(self, queued_s: float) -> None:
        """A request's first step was scheduled `queued_s` after it arrived."""
        self.histograms["request_queue_time_seconds"].observe(queued_s)

    def finished_request(self, reason: str, *, prompt_tokens: int, generation_tokens: int, e2e_s: float) -> None:
        """A request ended with a `final` reply: its usage and its end-to-end latency count."""
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.histograms["e2e_request_latency_seconds"].observe(e2e_s)

    def to_status(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "finished": dict(self.finished),
            "histograms": {name: h.to_status() for name, h in self.histograms.items()},
        }
