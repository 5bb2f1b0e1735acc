"""Optional GPU tracing of the step loop, to show where the GPU is idle between steps.

With `HYBRIDD_TRACE_DIR` set, a worker profiles its CUDA kernels with the PyTorch
profiler for `HYBRIDD_TRACE_STEPS` steps (default 200) after `HYBRIDD_TRACE_WARMUP`
steps (default 100) and writes `trace-<role>-<pid>.json` there. Kernel timestamps of
both workers share one clock, so `scripts/gpu_idle_gaps.py` can merge the two traces
and measure the time the GPU runs nothing from either process. With
`HYBRIDD_TRACE_CPU=1` the host side (CUDA runtime calls, operators) is recorded too.
Off by default: without the variable this costs one attribute check per step.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridd.log import get_logger

log = get_logger("step_trace")


class StepTracer:
    def __init__(self, role: str):
        directory = os.environ.get("HYBRIDD_TRACE_DIR")
        self.enabled = bool(directory)
        self.role = role
        if not self.enabled:
            return
        self.directory = Path(directory)
        self.warmup = int(os.environ.get("HYBRIDD_TRACE_WARMUP", "100"))
        self.steps = int(os.environ.get("HYBRIDD_TRACE_STEPS", "200"))
        self.count = 0
        self.profiler = None

    def step(self) -> None:
        """Call once per step, after the step's work is enqueued."""
        if not self.enabled:
            return
        self.count += 1
        if self.count == max(self.warmup, 1):
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CUDA]
            if os.environ.get("HYBRIDD_TRACE_CPU") == "1":
                activities.append(ProfilerActivity.CPU)
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
        elif self.count == self.warmup + self.steps and self.profiler is not None:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"trace-{self.role}-{os.getpid()}.json"
            self.profiler.export_chrome_trace(str(path))
            self.profiler = None
            self.enabled = False
            log.info("step_trace_written", path=str(path), steps=self.steps)
