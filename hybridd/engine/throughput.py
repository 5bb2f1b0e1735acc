"""Tokens per second over a sliding window (the last minute, for `status`)."""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 60.0


class Throughput:
    """Counts generated tokens by step; the rate is over the last `window_s`, or over the
    time since the first count when that is shorter."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._steps: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, tokens: int) -> None:
        if tokens:
            now = self._clock()
            self._steps.append((now, tokens))
            self._total += tokens
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._steps and now - self._steps[0][0] > self.window_s:
            self._total -= self._steps.popleft()[1]

    def per_second(self) -> float:
        now = self._clock()
        self._prune(now)
        span = min(self.window_s, now - self._started)
        return self._total / span if span > 0 else 0.0
