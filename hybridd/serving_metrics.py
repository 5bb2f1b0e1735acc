"""What the context generator counts about the requests it serves, for Prometheus.

Counters (tokens, finished requests by reason), latency histograms (time to first
token, inter-token latency, end-to-end latency, queue time, prefill and decode step
time) and size histograms (a finished request's prompt and generated tokens) are kept
where the request is served, each figure recorded once, so that the figures `/metrics` shows
are the ones `status` reports (its percentiles are read from the same histograms).
They travel in the `status` reply under `metrics` (see protocol/SPEC.md) and
are turned into Prometheus families by `hybridd.metrics`; they count from the start
of the worker pair (a restart resets them, which Prometheus reads as a counter reset).
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

# Bucket upper bounds in seconds. hybridd's latencies go far below vLLM's first
# buckets (a decode step takes a few milliseconds), so each list is fine from 1 to
# 10 ms, where a decode step's time lies, and then follows vLLM's.
_MS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.010, 0.015, 0.020, 0.030, 0.050)
TTFT_BOUNDS_S = (0.0005, *_MS, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BOUNDS_S = (0.0002, 0.0005, *_MS, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BOUNDS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

STEP_BOUNDS_S = (0.0005, *_MS, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# Tokens per request, as vLLM's request_prompt_tokens / request_generation_tokens: 1, 2, 5 per decade.
TOKEN_BOUNDS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))

HISTOGRAMS = {
    "time_to_first_token_seconds": TTFT_BOUNDS_S,
    "inter_token_latency_seconds": ITL_BOUNDS_S,
    "e2e_request_latency_seconds": REQUEST_BOUNDS_S,
    "request_queue_time_seconds": REQUEST_BOUNDS_S,
    "prefill_step_seconds": STEP_BOUNDS_S,
    "decode_step_seconds": STEP_BOUNDS_S,
    "request_prompt_tokens": TOKEN_BOUNDS,
    "request_generation_tokens": TOKEN_BOUNDS,
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

    def quantile(self, q: float) -> float | None:
        """The `q`-quantile (0..1), interpolated linearly inside its bucket (as Prometheus'
        histogram_quantile does); None when nothing was observed."""
        total = sum(self.counts)
        if not total:
            return None
        rank = q * total
        seen = 0
        for i, count in enumerate(self.counts):
            if count and seen + count >= rank:
                low = self.bounds[i - 1] if i else 0.0
                if i == len(self.bounds):  # the +Inf bucket: its lower bound is all that is known
                    return low
                return low + (self.bounds[i] - low) * (rank - seen) / count
            seen += count
        return self.bounds[-1]


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

    def step(self, seconds: float, *, prefill: bool) -> None:
        """A step's time on the device (see hybridd.engine.core.EngineOutputs)."""
        self.histograms["prefill_step_seconds" if prefill else "decode_step_seconds"].observe(seconds)

    def scheduled(self, queued_s: float) -> None:
        """A request's first step was scheduled `queued_s` after it arrived."""
        self.histograms["request_queue_time_seconds"].observe(queued_s)

    def finished_request(self, reason: str, *, prompt_tokens: int, generation_tokens: int, e2e_s: float) -> None:
        """A request ended with a `final` reply: its usage and its end-to-end latency count."""
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.histograms["e2e_request_latency_seconds"].observe(e2e_s)
        self.histograms["request_prompt_tokens"].observe(prompt_tokens)
        self.histograms["request_generation_tokens"].observe(generation_tokens)

    def latency(self) -> dict[str, Any]:
        """`status`'s latency map: percentiles of time to first token and inter-token latency."""
        ttft = self.histograms["time_to_first_token_seconds"]
        itl = self.histograms["inter_token_latency_seconds"]
        return {"ttft_p50_s": ttft.quantile(0.5), "ttft_p99_s": ttft.quantile(0.99),
                "itl_p50_s": itl.quantile(0.5), "itl_p99_s": itl.quantile(0.99), "window": sum(itl.counts)}

    def to_status(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "finished": dict(self.finished),
            "histograms": {name: h.to_status() for name, h in self.histograms.items()},
        }
