"""Optional tracing of the step loop: where the GPU is idle between steps, and where a
request's time goes on the host.

With `HYBRIDD_TRACE_DIR` set, a worker traces a window of `HYBRIDD_TRACE_STEPS` steps
after `HYBRIDD_TRACE_WARMUP` steps (the variables and their defaults are declared in
hybridd/environment.py):

- kernels (unless `HYBRIDD_TRACE_KERNELS=0`): the PyTorch profiler records its CUDA
  kernels into `trace-<role>-<pid>.json`. Kernel timestamps of both workers share one
  clock, so the two traces merge into one timeline of the GPU's idle gaps. With
  `HYBRIDD_TRACE_CPU=1` the host side (CUDA runtime calls, operators) is recorded too.
- host marks (`HYBRIDD_TRACE_MARKS=1`): the hot path calls `mark(name)` at its
  milestones (a request received, its step's inputs ready, the step sent, the graph
  launched, the tokens on the host, the chunk sent); each becomes a (name, step,
  nanoseconds) row in `marks-<role>-<pid>.json`. The clock is CLOCK_MONOTONIC
  (`time.perf_counter_ns`), the one the other worker and a client on the same host read,
  so `scripts/trace_requests.py` lays both workers' marks beside the client's times.
  Unlike the profiler, a mark costs a list append: the timings are the untraced ones.

Off by default: without the variable this costs one attribute check per step and one
global check per mark.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hybridd import environment
from hybridd.log import get_logger

log = get_logger("step_trace")

_marks: list[tuple[str, int, int]] | None = None  # set while a marks window is open
_step = 0


def mark(name: str) -> None:
    """Record that this worker reached `name` now (no-op outside a marks window)."""
    if _marks is not None:
        _marks.append((name, _step, time.perf_counter_ns()))


def _steps_variable(name: str) -> int:
    """A step count from the environment; a value that is not one names the variable."""
    try:
        steps = environment.number(name)
    except environment.EnvironmentVariableError:
        steps = -1
    if steps < 0:
        raise ValueError(f"{name} must be a whole number of steps (>= 0), got {environment.get(name)!r}")
    return int(steps)


class StepTracer:
    def __init__(self, role: str):
        directory = environment.get("HYBRIDD_TRACE_DIR")
        self.enabled = bool(directory)
        self.role = role
        if not self.enabled:
            return
        self.directory = Path(directory)
        self.warmup = _steps_variable("HYBRIDD_TRACE_WARMUP")
        self.steps = _steps_variable("HYBRIDD_TRACE_STEPS")
        self.kernels = environment.flag("HYBRIDD_TRACE_KERNELS")
        self.marks = environment.flag("HYBRIDD_TRACE_MARKS")
        self.count = 0
        self.profiler = None

    def step(self) -> None:
        """Call once per step, after the step's work is enqueued."""
        global _marks, _step
        if not self.enabled:
            return
        self.count += 1
        _step = self.count
        if self.count == max(self.warmup, 1):
            if self.marks:
                _marks = []
            if self.kernels:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CUDA]
                if environment.flag("HYBRIDD_TRACE_CPU"):
                    activities.append(ProfilerActivity.CPU)
                self.profiler = profile(activities=activities)
                self.profiler.__enter__()
        elif self.count == self.warmup + self.steps:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self.profiler is not None:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.profiler.__exit__(None, None, None)
                path = self.directory / f"trace-{self.role}-{os.getpid()}.json"
                self.profiler.export_chrome_trace(str(path))
                self.profiler = None
                log.info("step_trace_written", path=str(path), steps=self.steps)
            if _marks is not None:
                path = self.directory / f"marks-{self.role}-{os.getpid()}.json"
                path.write_text(json.dumps({"role": self.role, "clock": "perf_counter_ns", "marks": _marks}))
                _marks = None
                log.info("step_marks_written", path=str(path), steps=self.steps)
            self.enabled = False
