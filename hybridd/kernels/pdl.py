"""Programmatic dependent launch (PDL) for the fused kernels of a step.

A decode step is a few hundred short kernels, each bound by reading its weights; what
separates the step from the weight-read floor is mostly the time from one kernel's
last memory access to the next kernel's first: the launch, the new grid's ramp-up and
its first loads. On Hopper and newer a kernel launched with PDL may start while the
kernel before it in the stream is still running. It then waits (`gdc_wait`) for that
kernel's completion and memory before its first load of step data and before any
store, and lets its own successor launch right after. CUDA graphs capture these
launches as programmatic edges.

Every kernel launched with PDL waits, even one with nothing to read, so that the
order of the whole chain holds: a kernel completes only after its predecessor did.
Kernels launched without PDL (torch's, cuBLAS's) keep the stream's full ordering.

Supported devices launch with PDL unless the thread is inside `off()`: the model's
kernel set enters it for a step whose projections run on cuBLAS (whose kernels neither
wait nor let their successors launch early; there the chain measured slower with it)
and for every step where its `KernelChoices` turn PDL off (the daemon's `pdl` setting,
`HYBRIDD_PDL`). Through the daemon the gain reaches the client only when both workers
share the GPU through MPS (`cuda_mps`). Figures: docs/lab/kernels.md.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

from hybridd import environment

_INTERPRET = environment.flag("TRITON_INTERPRET")
_capable: dict[int, bool] = {}
_thread = threading.local()  # `off` per thread: the capture thread and the serving thread differ


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (supported, and not turned off
    for this thread by `off`)."""
    return not getattr(_thread, "off", False) and supported(device)


@contextlib.contextmanager
def off():
    """Launch this thread's kernels without PDL meanwhile."""
    before = getattr(_thread, "off", False)
    _thread.off = True
    try:
        yield
    finally:
        _thread.off = before


def supported(device: torch.device) -> bool:
    """Whether `device` can launch with PDL (CUDA, compute capability 9+, compiled kernels)."""
    if _INTERPRET or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for launching a kernel that takes `PDL: tl.constexpr` (and calls
    `wait_for_predecessor(PDL)`) on `device`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has completed and its writes are
    visible, then let the next kernel launch. Call before the first load of step data."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
