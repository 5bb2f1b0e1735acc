"""Interprocess events: GPU-side ordering between the two worker processes.

On CUDA an `InterprocessEvent` wraps `torch.cuda.Event(interprocess=True)`; its handle
travels in a control message and the peer opens it with `from_handle`. A `wait` must
be enqueued only after the peer has enqueued the matching `record`; the control
messages carry that fact. On the CPU the same interface does nothing (handle b""):
work there is synchronous, so ordering is already given by the messages.
"""

from __future__ import annotations

from typing import Any

import torch


class InterprocessEvent:
    """A CUDA IPC event, or a no-op stand-in on the CPU."""

    def __init__(self, event: Any | None, device: torch.device) -> None:
        self._event = event  # torch.cuda.Event, or None on the CPU
        self.device = device

    @classmethod
    def create(cls, device: torch.device | str) -> InterprocessEvent:
        device = torch.device(device)
        if device.type != "cuda":
            return cls(None, torch.device("cpu"))
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            # Interprocess events cannot record timing; blocking=False keeps
            # synchronize() a spin-then-yield instead of a driver sleep.
            event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
            event.record()  # materialize it on this device so the handle is valid
        return cls(event, torch.device("cuda", index))

    @classmethod
    def from_handle(cls, handle: bytes, device: torch.device | str | None = None) -> InterprocessEvent:
        """Open a peer's event; b"" gives the CPU no-op event."""
        if not handle:
            return cls(None, torch.device("cpu"))
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise ValueError(f"a CUDA event handle needs a cuda device, got {device}")
        return cls(torch.cuda.Event.from_ipc_handle(device, handle), device)

    @property
    def is_cuda(self) -> bool:
        return self._event is not None

    def ipc_handle(self) -> bytes:
        return b"" if self._event is None else bytes(self._event.ipc_handle())

    def record(self, stream: Any | None = None) -> None:
        if self._event is not None:
            self._event.record(stream)

    def wait(self, stream: Any | None = None) -> None:
        """Make `stream` (default: the current one) wait for the last record, without a host sync."""
        if self._event is not None:
            self._event.wait(stream)

    def synchronize(self) -> None:
        """Block the host until the last record has completed."""
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        """True when the last record has completed (always on the CPU)."""
        return True if self._event is None else bool(self._event.query())

    def __repr__(self) -> str:
        return f"InterprocessEvent({self.device})"
