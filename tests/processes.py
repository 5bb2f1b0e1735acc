"""Waiting for a process the test started (or watched) to stop running.

Whether it runs is `hybridd.ipc.posix_shm.pid_alive`'s answer, the one the supervisor acts on:
a zombie counts as stopped, and so does a pid reaped between two looks at it.
"""

from __future__ import annotations

import signal
import time

from hybridd.ipc.posix_shm import pid_alive as alive
from tests.host_load import on_this_host

__all__ = ["alive", "as_from_a_terminal", "wait_dead"]


def as_from_a_terminal() -> None:
    """A child's `preexec_fn`: Ctrl-C's default disposition, as a shell gives it (a test
    earlier in the run may have left this process ignoring SIGINT, which a child inherits)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_dead(pid: int, timeout: float = 5.0) -> bool:
    """Wait until `pid` no longer runs; `timeout` (idle-host seconds) scales with the load."""
    deadline = time.monotonic() + on_this_host(timeout)
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return not alive(pid)
