"""The step stream of a serving thread: the thread makes it its current stream once, for
good, so that its steps run without a stream switch each. `torch.cuda.stream`'s enter and
exit cost host time on every step, most on a core that has just woken, which a request's
first step runs on (docs/lab/benchmarks.md, "A step's launch"). Other threads still
switch to the stream per step and back. Without CUDA there is no stream and nothing to
switch."""

from __future__ import annotations

import contextlib
import threading

import torch


class ServingStream:
    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream = stream
        self.thread: int | None = None  # the bound thread's ident

    def bind_this_thread(self) -> None:
        """Make the stream this thread's current stream for good."""
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)
        self.thread = threading.get_ident()

    def entered(self) -> contextlib.AbstractContextManager:
        """What a step runs in: nothing on the bound thread or without CUDA, else a switch
        to the stream and back."""
        if self.stream is None or threading.get_ident() == self.thread:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)
