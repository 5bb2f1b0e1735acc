"""Interprocess events on the CPU: the CUDA interface, doing nothing."""

from __future__ import annotations

import torch

from hybridd.ipc.events import InterprocessEvent


def test_cpu_event_is_a_no_op_with_the_cuda_interface():
    event = InterprocessEvent.create(torch.device("cpu"))
    assert not event.is_cuda and event.device == torch.device("cpu")
    assert event.ipc_handle() == b""
    event.record()
    event.record(stream=None)
    event.wait()
    event.synchronize()
    assert event.query()


def test_empty_handle_opens_the_cpu_event():
    peer = InterprocessEvent.from_handle(InterprocessEvent.create("cpu").ipc_handle())
    assert not peer.is_cuda and peer.ipc_handle() == b""
    peer.wait()
    peer.synchronize()


def test_importing_events_loads_nothing_cuda_specific():
    import subprocess
    import sys

    code = "import sys, ipc.events, ipc.shared_arena; print('cupy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
